"""Maintainer tool (not imported at run time): regenerate the shipped corpus files.

The corpus comes from the Debian package ``r-cran-janeaustenr`` (the CRAN package
``janeaustenr`` 1.0.0 by Julia Silge, MIT; the novels themselves are Project Gutenberg
texts of public-domain works).  That package stores each novel as an R character vector
(one element per line) in an R lazy-load database (``data/Rdata.rdb`` + ``Rdata.rdx``).

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    pip install rdata            # one-off, only for this script
    python -m canzona_ds.data.extract_corpus pkg/usr/lib/R/site-library/janeaustenr/data

Every line is written unchanged, joined with "\\n"; nothing is added or edited.
"""
from __future__ import annotations

import gzip
import sys
import zlib
from pathlib import Path

#: R variable name -> file shipped next to this script
NOVELS = {"prideprejudice": "pride_and_prejudice.txt", "persuasion": "persuasion.txt"}


def _rdb_entry(raw: bytes) -> bytes:
    # lazy-load database entry: 4-byte big-endian length, then a zlib stream
    return zlib.decompress(raw[4:])


def extract(rdata_dir: Path, out_dir: Path) -> list[Path]:
    import rdata  # noqa: PLC0415 - optional maintainer dependency

    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((rdata_dir / "Rdata.rdx").read_bytes())))
    rdb = (rdata_dir / "Rdata.rdb").read_bytes()
    written = []
    for var, fname in NOVELS.items():
        off, length = (int(x) for x in index["variables"][var])
        lines = rdata.conversion.convert(rdata.parser.parse_data(_rdb_entry(rdb[off : off + length])))
        path = out_dir / fname
        path.write_text("\n".join(str(s) for s in lines) + "\n", encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for p in extract(Path(sys.argv[1]), Path(__file__).parent):
        print(p, p.stat().st_size, "bytes")
