"""Stage 1: load and validate the prompts, write the train / held-out split, log them as datasets."""
from __future__ import annotations

from pathlib import Path

from tlt.config import RunConfig
from tlt.prompts import Dataset, load_dataset
from tlt.preflight import check_reward_fn
from tlt.schemas import frame_digest
from tlt.summaries import DataSummary


def validate_data(cfg: RunConfig, tokenizer, run_dir: Path, tracker) -> tuple[Dataset, DataSummary]:
    """The run's dataset (bad rows dropped and reported), its splits as parquet in `run_dir`, the
    reward function tried on four rows; returns the dataset and its summary."""
    ds = load_dataset(cfg.data, tokenizer)
    train_path, heldout_path = run_dir / "train.parquet", run_dir / "heldout.parquet"
    ds.train.to_parquet(train_path)
    ds.heldout.to_parquet(heldout_path)
    check_reward_fn(cfg, ds.train.head(4))
    n_dropped = len(ds.dropped) if ds.dropped is not None else 0
    for frame, name, path, context in ((ds.train, "train-prompts", train_path, "train"),
                                       (ds.heldout, "heldout-prompts", heldout_path, "eval")):
        tracker.log_dataset(frame, name=name, digest=frame_digest(frame), source=str(path), context=context,
                            tags={"rows": len(frame), "source": cfg.data.path or "reasoning-gym"})
    if n_dropped:
        tracker.log_text(ds.report.format(), "data/dropped_rows.txt")
    tasks = ds.train["task"].value_counts().to_dict()
    tracker.log_metrics({"data/rows": ds.report.n_rows, "data/dropped": n_dropped,
                         "data/train": len(ds.train), "data/heldout": len(ds.heldout)}, step=0)
    return ds, DataSummary(n_rows=ds.report.n_rows, n_train=len(ds.train), n_heldout=len(ds.heldout),
                           n_dropped=n_dropped, tasks={str(k): int(v) for k, v in tasks.items()},
                           train_path=str(train_path), heldout_path=str(heldout_path))
