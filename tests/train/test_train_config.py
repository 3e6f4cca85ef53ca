"""train-eagle3 options that cannot work together are refused with a message."""

from __future__ import annotations

import pytest

from specserve.cli import main
from specserve.train.config import TrainConfig


def test_coverage_shrinking_and_an_initial_head_are_refused_together(tmp_path, capsys):
    with pytest.raises(ValueError, match="--init-head"):
        TrainConfig(
            out=str(tmp_path), data=["stdlib"], init_head=str(tmp_path), min_draft_coverage=0.99
        )
    rc = main(
        [
            "train-eagle3",
            "--out",
            str(tmp_path / "o"),
            "--data",
            "stdlib",
            "--init-head",
            str(tmp_path),
            "--min-draft-coverage",
            "0.99",
        ]
    )
    assert rc == 2 and "--init-head" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--train-time-s", "--gen-time-s"])
@pytest.mark.parametrize("seconds", ["0", "-5", "nan"])
def test_time_budgets_must_be_positive(tmp_path, capsys, flag, seconds):
    """--train-time-s 0 divided by zero once training began; negative budgets passed."""
    field = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=f"{flag} must be a positive number of seconds"):
        TrainConfig(out=str(tmp_path), **{field: float(seconds)})
    rc = main(["train-eagle3", "--out", str(tmp_path / "o"), flag, seconds])
    assert rc == 2 and f"{flag} must be a positive number" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
