"""``canzona-ckpt``: look into, check and consolidate a canzona-ds checkpoint.

    canzona-ckpt inspect DIR [--tag T]            tag, integrity, layout, optimizer, sizes, what each rank holds
    canzona-ckpt verify  DIR [--tag T] [--mode sha256|size]
                                                  the manifest (every file's bytes), the index (its own
                                                  consistency) and every chunk against the file that holds it
    canzona-ckpt convert DIR OUT [--tag T]        OUT/model.safetensors (fp32 weights by whole-model name),
                                                  OUT/optimizer.pt (every state by whole-model name),
                                                  OUT/info.json (what was converted, from where)

Every read unpickles only data (canzona_ds/ckpt/safe_load.py): ``verify`` and ``convert`` first
read every ``.pt`` file of the tag through the restricted unpickler (memory-mapped, no tensor
read) and refuse a file that holds any type but tensors' and the few DeepSpeed writes by name,
before that type is called (docs/checkpoints.md).
A tag is a closed world: every path its manifest, index or ``latest`` names must be relative,
stay inside the tag (``latest``: name a tag directory of ``DIR``) and be a regular file; anything
else is refused by name before a byte of it is read (docs/checkpoints.md, "Threat model").
``--tag`` defaults to the one ``DIR/latest`` names.  Exit status: 0 ok, 2 a problem (one line on
stderr naming the file and what is wrong), 3 a malformed tag that no check names (one line; a
canzona-ds bug worth reporting).  ``convert`` reads through the checkpoint index; a tag without one (written
before the index) or whose index describes no chunks (tensor parallelism at ZeRO stage 0) is
refused by name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

PROG = "canzona-ckpt"


def _tag(folder: str, tag: str | None) -> str:
    from ..ckpt.tag import LATEST, read_latest

    if tag is not None:
        return tag
    latest = read_latest(folder)  # (a tag directory of `folder`, else refused by name)
    if latest is None:
        raise ValueError(f"{folder} has no {LATEST} file; name the tag with --tag.")
    return latest


def _integrity(folder: str, tag: str, mode: str) -> str:
    from ..ckpt import tag as ck

    try:
        ck.verify(folder, tag, mode)
    except ck.CheckpointError as e:
        return f"NOT intact: {e}"
    return f"intact ({mode} of every file matches {ck.MANIFEST})"


def inspect(folder: str, tag: str | None, out=None) -> int:
    out = sys.stdout if out is None else out  # (the stream at call time, not at import)
    from ..ckpt.index import INDEX, Index

    tag = _tag(folder, tag)
    path = os.path.join(folder, tag)
    if not os.path.isdir(path):
        raise ValueError(f"{path} does not exist.")
    print(f"checkpoint {path}", file=out)
    print(f"  integrity: {_integrity(folder, tag, 'size')}", file=out)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
             if os.path.isfile(os.path.join(path, f))}
    print(f"  files: {len(sizes)}, {sum(sizes.values()):,} bytes", file=out)
    for f, n in sizes.items():
        print(f"    {n:>14,}  {f}", file=out)
    if not os.path.lexists(os.path.join(path, INDEX)):
        print(f"  index: none ({INDEX} missing: written before the index, or an incomplete save)", file=out)
        return 0
    index = Index.read(path)
    m = index.meta
    print(f"  layout: ZeRO stage {m.get('stage')}, DP={m.get('dp')} TP={m.get('tp')} PP={m.get('pp')}, "
          f"world size {m.get('world_size')}", file=out)
    roles = m.get("roles", {})
    n_mat = sum(r == "matrix" for r in roles.values())
    print(f"  optimizer: rule {m.get('rule')!r} on {n_mat} matrices, AdamW on {len(roles) - n_mat} parameters; "
          f"matrix step {m.get('matrix_step')}, AdamW step {m.get('adam_step')}", file=out)
    if index.chunks is None:
        print(f"  chunks: not described ({m.get('no_chunks')})", file=out)
        return 0
    held: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in index.chunks:
        held[c.rank]["chunks"] += 1
        held[c.rank][c.state if c.state in ("param", "exp_avg", "exp_avg_sq") else "rule state"] += c.length
    print(f"  chunks: {len(index.chunks)} over {len(index.names)} parameters; elements each rank holds:", file=out)
    for r in sorted(held):
        parts = ", ".join(f"{k} {v:,}" for k, v in held[r].items() if k != "chunks")
        print(f"    rank {r}: {held[r]['chunks']} chunks; {parts}", file=out)
    return 0


def verify(folder: str, tag: str | None, mode: str, out=None) -> int:
    out = sys.stdout if out is None else out  # (the stream at call time, not at import)
    from ..ckpt import tag as ck
    from ..ckpt.index import INDEX, Index, Reader

    tag = _tag(folder, tag)
    path = os.path.join(folder, tag)
    ck.verify(folder, tag, mode)
    print(f"{path}: manifest: every file's {mode} matches", file=out)
    from ..integration.ckpt.safe import check_tag

    check_tag(path)  # a manifest proves a tag whole, not harmless: every file holds only data
    print(f"{path}: pickles: every file holds only data (tensors and the types DeepSpeed writes)", file=out)
    if not os.path.lexists(os.path.join(path, INDEX)):
        print(f"{path}: no {INDEX} (written before the index): the manifest is all there is to check", file=out)
        return 0
    index = Index.read(path)
    if index.chunks is not None:
        from ..integration.ckpt.safe import read

        reader = Reader(path, index, read)  # (only data unpickled: ckpt/safe_load.py)
        for c in index.chunks:
            reader.stored(c)  # every chunk's key resolves to a tensor long enough to hold it
    n = "no chunks described" if index.chunks is None else f"{len(index.chunks)} chunks agree with their files"
    print(f"{path}: index: consistent, {n}", file=out)
    return 0


def _consolidated(path: str) -> tuple[dict, dict, dict]:
    """(name -> fp32 weight, name -> {state: tensor}, info), every tensor whole."""
    from ..ckpt.index import INDEX, MASTER, Index

    if not os.path.lexists(os.path.join(path, INDEX)):
        raise ValueError(f"{path} has no {INDEX}: written before the checkpoint index, so it cannot be consolidated. "
                         "Resume it at the layout it was saved at and save once: that save writes the index.")
    index = Index.read(path)
    if index.chunks is None:
        raise ValueError(f"{path}: its index describes no chunks ({index.meta.get('no_chunks')}), so it cannot be "
                         "consolidated.")
    from ..integration.ckpt.fill import IndexSource

    src = IndexSource(path, index)  # (a TP host's state: to TP=1 through its rule's state_axes)
    reader = src.reader
    weights = {n: reader.whole(n, MASTER).detach().clone() for n in index.names}  # (views of the files otherwise)
    state: dict[str, dict] = defaultdict(dict)
    for name, key in index.by_key():
        if key != MASTER:
            tp1 = src.state_of(name)[key] if reader.frame_of(name, key) is not None else reader.whole(name, key)
            state[name][key] = tp1.detach().clone()
    info = {k: index.meta.get(k) for k in ("stage", "dp", "tp", "pp", "rule", "roles", "matrix_step",
                                           "adam_step")}
    return weights, dict(state), info


def convert(folder: str, tag: str | None, out_dir: str, out=None) -> int:
    out = sys.stdout if out is None else out  # (the stream at call time, not at import)
    import torch
    from safetensors.torch import save_file

    tag = _tag(folder, tag)
    path = os.path.join(folder, tag)
    if not os.path.isdir(path):
        raise ValueError(f"{path} does not exist.")
    from ..integration.ckpt.safe import check_tag

    check_tag(path)  # every file holds only data before any is read
    weights, state, info = _consolidated(path)
    os.makedirs(out_dir, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    torch.save({"format": "canzona_ds.ckpt.consolidated/1", "state": state, **info},
               os.path.join(out_dir, "optimizer.pt"))
    with open(os.path.join(out_dir, "info.json"), "w", encoding="utf-8") as f:
        json.dump({"source": os.path.abspath(path), "parameters": len(weights),
                   "with_state": len(state), **{k: v for k, v in info.items() if k != "roles"}}, f, indent=1)
    print(f"wrote {out_dir}: model.safetensors ({len(weights)} parameters), optimizer.pt ({len(state)} with state, "
          f"rule {info.get('rule')!r}), from {path} (DP={info.get('dp')} TP={info.get('tp')})", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description="Inspect, verify and consolidate canzona-ds checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("inspect", "what the checkpoint holds"), ("verify", "check it byte for byte"),
                           ("convert", "consolidated files by whole-model name")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("dir", help="the checkpoint directory (holding the tags and `latest`)")
        if name == "convert":
            p.add_argument("out", help="output directory")
        p.add_argument("--tag", default=None, help="the tag (default: the one `latest` names)")
        if name == "verify":
            p.add_argument("--mode", choices=["sha256", "size"], default="sha256")
    args = ap.parse_args(argv)
    from ..ckpt import tag as ck
    from ..ckpt.index import CheckpointIndexError

    try:
        if args.cmd == "inspect":
            return inspect(args.dir, args.tag)
        if args.cmd == "verify":
            return verify(args.dir, args.tag, args.mode)
        return convert(args.dir, args.tag, args.out)
    except (ck.CheckpointError, CheckpointIndexError, ValueError, OSError) as e:
        print(f"{PROG} {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a malformed tag nothing above names: one line, its own code
        print(f"{PROG} {args.cmd}: error: {args.dir}: unexpected {type(e).__name__} reading it: {_one_line(e)} "
              "(a malformed checkpoint no check names; please report it)", file=sys.stderr)
        return 3


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:2000]


if __name__ == "__main__":
    raise SystemExit(main())
