"""The model settings as a user writes them: the README's price example parses, bad price
tables are refused with what is wrong, and `covey serve` says when no model is configured."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from covey.config import Settings, model_url_warning
from covey.coveyd import DEFAULT_PRICES, DaemonError, model_prices

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readmes_price_example_parses() -> None:
    [line] = [ln for ln in README.read_text().splitlines()
              if re.match(r"^COVEY_MODEL_PRICES=", ln)]
    raw = shlex.split(line.split("=", 1)[1])[0]  # as the shell hands it to the process
    prices = model_prices(raw)
    assert prices["claude-3-5-haiku"] == (0.80, 4.00)
    assert prices["llama3.1:8b"] == (0.0, 0.0)
    assert prices["puppet"] == DEFAULT_PRICES["puppet"]  # the built-in ones stay


@pytest.mark.parametrize("raw", ['["gpt-4o", 1, 2]', '{"m": [1]}', '{"m": "1,2"}',
                                 '{"m": [1, "two"]}', "not json"])
def test_a_price_table_that_is_not_one_is_refused(raw: str) -> None:
    with pytest.raises(DaemonError, match="COVEY_MODEL_PRICES is not"):
        model_prices(raw)


def test_serve_warns_when_no_model_url_is_configured(tmp_path: Path) -> None:
    unset = Settings.from_env({"COVEY_DATA_DIR": str(tmp_path)})
    warning = model_url_warning(unset)
    assert warning is not None
    assert "COVEY_MODEL_URL is not set" in warning and "http://127.0.0.1:11434/v1" in warning
    configured = Settings.from_env({"COVEY_DATA_DIR": str(tmp_path),
                                    "COVEY_MODEL_URL": "http://127.0.0.1:4000/v1"})
    assert model_url_warning(configured) is None
