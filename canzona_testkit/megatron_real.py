"""The real Megatron-DeepSpeed for the ``megatron_real`` test tier (tests/test_megatron_real.py).

Where it comes from, in this order:

1. ``MEGATRON_DEEPSPEED=<checkout>``: a Megatron-DeepSpeed checkout (copied, then patched and
   built in the copy; the checkout itself is never written);
2. ``../shared/third_party/Megatron-DeepSpeed-*.tar.gz`` relative to the repository root (the
   pristine snapshot, README.md there);
3. neither: :func:`source` returns None and the reason, and the tier skips with it.

:func:`prepare` unpacks (or copies) it once into ``<repo>/.megatron_ds/<sha256 of the archive
or the checkout path>/`` (gitignored), applies :data:`PATCHES` there, builds the dataset helpers
(``make`` in ``megatron/data``: needs ``pybind11``, the ``test`` extra), and writes a tiny
indexed dataset of the shipped corpus (canzona_ds/data/*.txt, bytes as tokens of Megatron's
``NullTokenizer``) with Megatron's own ``MMapIndexedDatasetBuilder`` (its tools/preprocess_data.py
needs nltk for nothing a byte-token dataset uses).  Later calls find the ``ready`` marker.

:func:`command` is the documented launch (launch/megatron_pretrain_gpt.py's docstring, docs/tp.md):
``deepspeed --num_gpus N launch/megatron_pretrain_gpt.py <meg>/pretrain_gpt.py <args>``, with
the CPU flags the snapshot's README lists.  :func:`iterations` reads Megatron's own log lines.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = ROOT.parent / "shared" / "third_party"
CACHE = ROOT / ".megatron_ds"
CAPTURE = Path(__file__).resolve().parent / "megatron_capture"


@dataclass(frozen=True)
class Patch:
    file: str
    old: str
    new: str
    why: str
    #: applied only where this module cannot be imported ("": always)
    unless_module: str = ""

    def needed(self) -> bool:
        if not self.unless_module:
            return True
        import importlib.util

        try:
            return importlib.util.find_spec(self.unless_module) is None
        except ModuleNotFoundError:
            return True


#: The only changes the test's copy gets (README.md in ../shared/third_party): each replaces one
#: exact text once; a copy where ``old`` is absent and ``new`` present is already patched.  Which
#: apply depends on the installed DeepSpeed (:meth:`Patch.needed`): one copy per set.
PATCHES = (
    Patch("megatron/training.py",
          "from deepspeed.compression.compress import init_compression, redundancy_clean\n",
          "try:\n    from deepspeed.compression.compress import init_compression, redundancy_clean\n"
          "except ImportError:  # canzona-ds test kit: DeepSpeed 0.19.8 has no deepspeed.compression.compress\n"
          "    init_compression = redundancy_clean = None\n",
          "DeepSpeed 0.19.7 removed deepspeed.compression.compress; GPT pretraining without "
          "compression_training never calls it (releases that have it run Megatron-DeepSpeed unpatched)",
          unless_module="deepspeed.compression.compress"),
    Patch("megatron/training.py",
          "from megatron.model.vision.knn_monitor import compute_feature_bank\n",
          "try:\n    from megatron.model.vision.knn_monitor import compute_feature_bank\n"
          "except ImportError:  # canzona-ds test kit: torchvision is not installed\n"
          "    compute_feature_bank = None\n",
          "the vision kNN monitor imports torchvision at module level; GPT never uses it"),
)

#: pretrain_gpt.py flags a CPU run needs (README.md in ../shared/third_party)
CPU_FLAGS = ("--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo")


def source() -> tuple[str | None, str]:
    """(a checkout folder or an archive path, how it was found), or (None, why there is none)."""
    env = os.environ.get("MEGATRON_DEEPSPEED")
    if env:
        if not Path(env, "pretrain_gpt.py").is_file():
            return None, f"MEGATRON_DEEPSPEED={env!r} has no pretrain_gpt.py"
        return env, "MEGATRON_DEEPSPEED"
    found = sorted(glob.glob(str(THIRD_PARTY / "Megatron-DeepSpeed-*.tar.gz")))
    if found:
        return found[-1], "the snapshot in ../shared/third_party"
    return None, (f"no Megatron-DeepSpeed: set MEGATRON_DEEPSPEED=<checkout>, or put the snapshot "
                  f"Megatron-DeepSpeed-*.tar.gz in {THIRD_PARTY}")


def _key(src: str) -> str:
    h = hashlib.sha256()
    if Path(src).is_file():
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(str(Path(src).resolve()).encode())
    h.update(repr(needed_patches()).encode())
    return h.hexdigest()[:16]


def needed_patches() -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if p.needed())


def apply_patches(meg: Path) -> None:
    for p in needed_patches():
        path = meg / p.file
        text = path.read_text()
        if p.old in text:
            path.write_text(text.replace(p.old, p.new, 1))
        elif p.new not in text:
            raise RuntimeError(f"patch for {p.file} ({p.why}) does not apply: neither its old nor its new text "
                               "is there (another Megatron-DeepSpeed commit?)")


def prepare() -> Path:
    """The patched, built Megatron-DeepSpeed copy with ``data/corpus_text_document`` beside it
    (``<cache>/Megatron-DeepSpeed``); built once per source."""
    src, how = source()
    if src is None:
        raise RuntimeError(how)
    home = CACHE / _key(src)
    meg, data = home / "Megatron-DeepSpeed", home / "data" / "corpus_text_document"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / "ready").is_file():
            return meg
        if meg.exists():
            shutil.rmtree(meg)
        if Path(src).is_file():
            with tarfile.open(src) as tar:
                tar.extractall(home, filter="data")
            if not meg.is_dir():
                raise RuntimeError(f"{src} does not unpack to Megatron-DeepSpeed/")
        else:
            shutil.copytree(src, meg, ignore=shutil.ignore_patterns(".git", "*.so"))
        apply_patches(meg)
        subprocess.run(["make"], cwd=meg / "megatron" / "data", check=True, capture_output=True, timeout=600)
        data.parent.mkdir(exist_ok=True)
        corpus = sorted(glob.glob(str(ROOT / "canzona_ds" / "data" / "*.txt")))
        subprocess.run([sys.executable, "-c", _DATASET, str(data), *corpus], cwd=meg, check=True,
                       capture_output=True, timeout=600)
        (home / "ready").write_text(how + "\n")
    return meg


#: Megatron's own MMapIndexedDatasetBuilder: one document per paragraph, its UTF-8 bytes as
#: tokens (NullTokenizer --vocab-size 256: ids 0..255, end of document 256)
_DATASET = """
import sys, torch
sys.path.insert(0, '.')
from megatron.data.indexed_dataset import make_builder
prefix, files = sys.argv[1], sys.argv[2:]
builder = make_builder(prefix + '.bin', 'mmap', vocab_size=257)
for f in files:
    for para in open(f, encoding='utf-8').read().split('\\n\\n'):
        data = para.strip().encode('utf-8')
        if len(data) >= 16:
            builder.add_item(torch.tensor(list(data), dtype=torch.int64))
            builder.end_document()
builder.finalize(prefix + '.idx')
"""


def data_prefix(meg: Path) -> str:
    return str(meg.parent / "data" / "corpus_text_document")


def command(meg: Path, nprocs: int, args: list[str], ds_config: str) -> list[str]:
    """The documented launch: the ``deepspeed`` launcher runs the shim, which runs pretrain_gpt.py
    (``--master_port``: a free one, as several launches may share the machine)."""
    from .dist import free_port

    return ["deepspeed", "--num_gpus", str(nprocs), "--master_port", str(free_port()), str(ROOT / "launch" / "megatron_pretrain_gpt.py"),
            str(meg / "pretrain_gpt.py"), *args, *CPU_FLAGS, "--deepspeed", "--deepspeed_config", ds_config]


def env(capture_dir: str | None = None) -> dict[str, str]:
    """This checkout's canzona_ds and test kit first on the path (and the capture hook with
    ``capture_dir``), one thread per rank, a free port."""
    path = [str(ROOT)] + ([str(CAPTURE)] if capture_dir else [])
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if capture_dir:
        e["CANZONA_CAPTURE_DIR"] = capture_dir
    else:
        e.pop("CANZONA_CAPTURE_DIR", None)
    return e


_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.Ee+-]+) \|.*?lm loss: ([0-9.Ee+-]+) \|")


#: how canzona_ds's start-up line begins (integration/builder.py ``startup_line``; read from a
#: real deepspeed.initialize by tests/test_resume_schedule.py, so a renamed prefix fails there)
START_PREFIX = "canzona_ds: "


def start_lines(log: str) -> list[str]:
    """canzona_ds's start-up lines in a run's log."""
    return [x for x in log.splitlines() if x.startswith(START_PREFIX)]


def iterations(log: str) -> dict[int, tuple[float, float]]:
    """iteration -> (learning rate, lm loss) from Megatron's own log lines (--log-interval 1)."""
    return {int(m.group(1)): (float(m.group(2)), float(m.group(3))) for m in _ITER.finditer(log)}
