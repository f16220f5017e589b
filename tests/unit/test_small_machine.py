"""vllm-dflash2 serve's process layout on small CPU machines (vllm_dflash2.small_machine)."""

from vllm_dflash2 import small_machine


def test_small_cpu_machines_get_the_worker_in_the_engine_process():
    env = {}
    applied = small_machine.apply(env, cpus=2, cpu_backend=True)
    assert env == applied == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    line = small_machine.describe(applied, cpus=2)
    assert "2 CPU cores" in line and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in line


def test_a_users_setting_wins():
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    applied = small_machine.apply(env, cpus=2, cpu_backend=True)
    assert applied == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_larger_machines_and_gpus_keep_vllms_defaults():
    for cpus, cpu_backend in ((small_machine.MAX_CPUS + 1, True), (2, False), (0, True)):
        env = {}
        assert small_machine.apply(env, cpus=cpus, cpu_backend=cpu_backend) == {}
        assert env == {}
