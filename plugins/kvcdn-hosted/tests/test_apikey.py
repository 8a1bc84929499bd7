"""`kvcdn api-key set` checks the kv_ + 64 hex form and says which part is wrong."""

import pytest

from kvcdn_core.errors import KvcdnError
from kvcdn_hosted.apikey import validate_api_key

GOOD = "kv_" + "0123456789abcdef" * 4


def test_good_key_is_normalized():
    assert validate_api_key(GOOD) == GOOD
    assert validate_api_key("  kv_" + GOOD[3:].upper() + "\n") == GOOD


@pytest.mark.parametrize(
    "key, fragment",
    [
        ("", "empty"),
        ("kx_" + "a" * 64, "must start with 'kv_'"),
        ("KV_" + "a" * 64, "must start with 'kv_'"),
        ("kv_" + "a" * 10 + "g" + "a" * 53, "non-hex character 'g' at position 14"),
        ("kv_" + "a" * 63, "63 hex characters after 'kv_', expected 64"),
        ("kv_" + "a" * 65, "65 hex characters"),
        ("kv_" + "a" * 30 + " " + "a" * 33, "non-hex character ' ' at position 34"),
    ],
)
def test_bad_key_says_which_part(key, fragment):
    with pytest.raises(KvcdnError) as err:
        validate_api_key(key)
    assert fragment in str(err.value)


def test_cli_set_stores_only_valid_keys(config_home):
    from click.testing import CliRunner

    from kvcdn_core.cli.app import make_cli
    from kvcdn_hosted import credentials

    runner = CliRunner()
    bad = runner.invoke(make_cli(), ["api-key", "set", "kv_123"])
    assert bad.exit_code == 2 and "3 hex characters" in bad.stderr
    assert not credentials.credentials_path().exists()
    ok = runner.invoke(make_cli(), ["api-key", "set", "-"], input=GOOD + "\n")
    assert ok.exit_code == 0, ok.stderr
    assert GOOD not in ok.stdout  # shown masked
    assert credentials.load()["api_key"] == GOOD
    cleared = runner.invoke(make_cli(), ["api-key", "clear"])
    assert cleared.exit_code == 0 and "api_key" not in credentials.load()
