"""Every invalid optimizer setting generated from the config dataclasses (wrong types, null,
non-finite, out of range, misspelt keys, malformed sections: canzona_testkit.fuzz) is
refused with a ValueError/TypeError naming the key as the user wrote it."""
from __future__ import annotations

import pytest

from canzona_testkit.fuzz import check, invalid_settings

CASES = list(invalid_settings())


def test_the_fuzz_covers_every_key_of_every_type():
    from canzona_ds.config import all_keys

    assert len(CASES) > 300
    for opt_type in ("CanzonaMuon", "CanzonaShampoo", "CanzonaSOAP"):
        named = {c.names for c in CASES if c.optimizer_type == opt_type}
        assert set(all_keys(opt_type)) <= named, set(all_keys(opt_type)) - named


@pytest.mark.parametrize("case", CASES, ids=[f"{c.optimizer_type}-{c.names}-{c.what}" for c in CASES])
def test_invalid_setting_is_refused_naming_the_key(case):
    refused, message = check(case)
    assert refused, f"{case}: {message}"
