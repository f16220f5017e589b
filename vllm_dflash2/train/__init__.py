"""DFlash2 drafter training (self-distillation) for vllm-dflash2."""
