"""Local benchmark files in the Hub datasets' own splits and columns, checked before lm-eval reads them.

Layout under --data-dir (any of .jsonl/.json, .parquet, .csv per split, as the Hub ships or `datasets` exports them):

    mmlu_pro/test.*  mmlu_pro/validation.*   TIGER-Lab/MMLU-Pro
    ifeval/train.*                           google/IFEval
    gpqa_diamond/train.*                     Idavidrein/gpqa, config gpqa_diamond
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# data format -> the `datasets` builder lm-eval's `dataset_path` names
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Schema:
    folder: str
    splits: tuple[str, ...]
    columns: tuple[str, ...]  # the columns lm-eval's task reads (the Hub files have these and may have more)
    source: str


SCHEMAS = {
    "mmlu_pro": Schema("mmlu_pro", ("test", "validation"),
                       ("question_id", "question", "options", "answer", "answer_index", "cot_content", "category"),
                       "TIGER-Lab/MMLU-Pro"),
    "ifeval": Schema("ifeval", ("train",), ("key", "prompt", "instruction_id_list", "kwargs"), "google/IFEval"),
    "gpqa_diamond": Schema("gpqa_diamond", ("train",),
                           ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                            "Incorrect Answer 3"), "Idavidrein/gpqa (config gpqa_diamond)"),
}


def offline():
    """Never let `datasets` or the Hub client reach the network (set before either is imported)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


@dataclass(frozen=True)
class LocalData:
    builder: str  # json / parquet / csv
    files: dict[str, str]  # split -> absolute path


def find_split(folder: Path, split: str) -> Path:
    found = sorted(p for p in folder.glob(f"{split}.*") if p.suffix in BUILDERS)
    if not found:
        raise SpecquantError(f"no {split} split in {folder}: expected {split}.jsonl, {split}.parquet or {split}.csv")
    if len(found) > 1:
        raise SpecquantError(f"{folder} has {len(found)} files for split {split!r} ({', '.join(p.name for p in found)}); "
                             "keep one")
    return found[0]


def locate(gate: str, data_dir: str | os.PathLike | None) -> LocalData:
    """The gate's local files, with their split names and builder; a missing folder/split is a one-line error."""
    schema = SCHEMAS[gate]
    root = Path(data_dir) if data_dir is not None else FIXTURES
    if not root.is_dir():
        raise SpecquantError(f"data directory {str(root)!r} does not exist; pass --data-dir DIR holding "
                             f"{', '.join(s.folder + '/' for s in SCHEMAS.values())} (docs/GATES.md)")
    folder = root / schema.folder
    if not folder.is_dir():
        raise SpecquantError(f"the {gate} gate needs {folder}/ with {' and '.join(schema.splits)} split file(s) "
                             f"from {schema.source}; add it or drop {gate} from --tasks")
    files = {split: find_split(folder, split) for split in schema.splits}
    builders = {BUILDERS[p.suffix] for p in files.values()}
    if len(builders) > 1:
        raise SpecquantError(f"{folder}: splits in different formats ({', '.join(p.name for p in files.values())}); "
                             "use one format per task")
    return LocalData(builders.pop(), {split: str(p.resolve()) for split, p in files.items()})


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or logged tracebacks from `datasets` during the check: its failure becomes our one line."""
    import datasets

    logger = logging.getLogger("datasets")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def check_columns(gate: str, data: LocalData) -> dict:
    """Load each split with `datasets` (as lm-eval will) and check the columns the task reads; split -> Dataset."""
    import datasets

    schema = SCHEMAS[gate]
    loaded = {}
    for split, path in data.files.items():
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(data.builder, data_files={split: path}, split=split)
        except Exception as e:  # noqa: BLE001 - any parse failure is bad input: say which file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecquantError(f"cannot read {path} as {data.builder} ({first}); export it from {schema.source} "
                                 "with datasets' to_json/to_parquet/to_csv") from None
        missing = [c for c in schema.columns if c not in ds.column_names]
        if missing:
            raise SpecquantError(f"{path} lacks column(s) {', '.join(missing)} of {schema.source}; it has "
                                 f"{', '.join(ds.column_names)}")
        if len(ds) == 0:
            raise SpecquantError(f"{path} has no rows")
        loaded[split] = ds
    return loaded
