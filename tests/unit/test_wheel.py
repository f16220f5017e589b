"""The wheel carries what the package needs at run time.

Builds a wheel from a copy of the sources (no native build: VLLM_DFLASH2_SKIP_BUILD=1),
installs it into a fresh virtual environment outside the checkout and, from a directory
outside the checkout, runs ``vllm-dflash2 check`` on a tiny pair, the held-out prompt
loader and ``vllm-dflash2 eval --help``. The new environment sees this interpreter's
site-packages through a ``.pth`` line (vLLM, torch: nothing is downloaded); lines of a
``.pth`` file are plain ``sys.path`` entries, so the checkout's editable install (itself a
``.pth`` hook there) stays inactive and ``vllm_dflash2`` can only come from the wheel.
"""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What setup.py/setup.cfg read: metadata, the README (long_description) and the package.
_SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "vllm_dflash2")

_PROBE = """
import json, vllm_dflash2
from vllm_dflash2.train.prompts import held_out_prompts
held = held_out_prompts()
print("PROBE", json.dumps({"file": vllm_dflash2.__file__, "n": len(held),
                           "kinds": sorted({p["kind"] for p in held})}))
"""


def _run(cmd, cwd, env, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_wheel_installed_outside_the_checkout_works(tmp_path, tiny_target, tiny_drafter):
    # A copy of the sources, so that a stale build/ in the checkout cannot leak into the wheel.
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build")
    for name in _SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VLLM_DFLASH2_SKIP_BUILD"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INDEX"] = "1"
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "--wheel-dir", str(wheels), str(src)], cwd=tmp_path, env=env)
    (wheel,) = wheels.glob("vllm_dflash2-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=env)
    py = venv / "bin" / "python"
    venv_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          cwd=tmp_path, env=env).strip())
    (venv_site / "outer_site_packages.pth").write_text(
        "".join(p + "\n" for p in site.getsitepackages()))
    # pip itself comes from the outer site-packages and installs into the new venv.
    _run([str(py), "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", str(wheel)],
         cwd=tmp_path, env=env)

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    line = [x for x in _run([str(py), "-c", _PROBE], cwd=cwd, env=env).splitlines()
            if x.startswith("PROBE ")][0]
    probe = json.loads(line[len("PROBE "):])
    installed = Path(probe["file"]).resolve()
    assert installed.is_relative_to(venv_site.resolve()), installed
    assert not installed.is_relative_to(ROOT), installed
    assert probe["kinds"] == ["chat", "code"] and probe["n"] > 0, probe

    cli = str(venv / "bin" / "vllm-dflash2")
    out = _run([cli, "check", "--target", str(tiny_target), "--drafter", str(tiny_drafter)],
               cwd=cwd, env=env)
    assert out.startswith("ok: "), out
    out = _run([cli, "eval", "--help"], cwd=cwd, env=env)
    assert "--prompts" in out, out
