"""Stage 0: vanilla SPD rollouts on training prompts with judge labels at their mismatches.

``run_data_gen(DataGenConfig(...))`` writes the dataset (resumable Parquet shards);
``load_data_gen(output_dir)`` reads it back as one ``datasets.Dataset``.
"""

from data_gen.config import DataGenConfig, parse_config
from data_gen.dataset import FEATURES, load_data_gen, read_manifest
from data_gen.judges import Judge, Judgement, ModelJudge, OutcomeJudge, label_of, outcome_of
from data_gen.main import main, run_data_gen

__all__ = [
    "FEATURES",
    "DataGenConfig",
    "Judge",
    "Judgement",
    "ModelJudge",
    "OutcomeJudge",
    "label_of",
    "load_data_gen",
    "main",
    "outcome_of",
    "parse_config",
    "read_manifest",
    "run_data_gen",
]
