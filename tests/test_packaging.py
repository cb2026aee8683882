"""The installed package is the library: ``pip install .`` ships ``canzona_ds`` and nothing of the
test kit (``canzona_testkit/`` at the repository root: gloo runner, tiny models, Megatron
stand-in, baselines), which tests and benchmarks import from the checkout.

The source is copied to a temporary directory first (pip builds in tree, and the build's
``build/`` and ``*.egg-info`` must not land in the checkout), the copy includes the kit (so
leaving it out is the packaging's doing), and pip runs offline: ``--no-deps
--no-build-isolation --no-index`` into a ``--target`` folder.

Cost: 1 launching test; 3 s on a 2-core AMD EPYC (docs/ci.md).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("setup.cfg", "pyproject.toml", "README.md", "canzona_ds", "canzona_testkit")


def _install(tmp: Path) -> Path:
    src, target = tmp / "src", tmp / "site"
    src.mkdir()
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    assert (src / "canzona_testkit" / "dist.py").is_file()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "--target", str(target), str(src)],
                   check=True, cwd=tmp, capture_output=True, text=True)
    return target


def test_wheel_holds_the_library_only(tmp_path: Path) -> None:
    target = _install(tmp_path)

    records = list(target.glob("canzona_ds-*.dist-info/RECORD"))
    assert len(records) == 1, records
    files = [line.split(",")[0] for line in records[0].read_text().splitlines() if line]
    assert any(f == "canzona_ds/optim/muon.py" for f in files), files[:20]
    assert any(f == "canzona_ds/data/persuasion.txt" for f in files), "package data missing"
    top = {f.split("/")[0] for f in files}
    assert {t for t in top if not t.endswith(".dist-info") and t not in ("bin", "..")} == {"canzona_ds"}, top
    kit = [f for f in files if "testing" in f.split("/") or "canzona_testkit" in f or f.startswith("tests/")]
    assert kit == [], kit
    assert (records[0].parent / "top_level.txt").read_text().split() == ["canzona_ds"]

    # the installed package, imported from outside the checkout: the library is there, the kit is not
    probe = ("import importlib.util, pathlib, sys\n"
             "import canzona_ds\n"
             "assert pathlib.Path(canzona_ds.__file__).is_relative_to(sys.argv[1]), canzona_ds.__file__\n"
             "import canzona_ds.optim.muon\n"
             "for name in ('canzona_ds.testing', 'canzona_testkit'):\n"
             "    try:\n"
             "        __import__(name)\n"
             "    except ModuleNotFoundError as e:\n"
             "        assert e.name == name, (name, e.name)\n"
             "    else:\n"
             "        raise SystemExit(f'{name} is importable from the installed package')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
