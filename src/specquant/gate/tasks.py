"""lm-eval's own task definitions, pointed at local files: one override YAML per gate in an `--include_path` folder.

Each override `include:`s lm-eval's task (or group) YAML and replaces only where the data comes from (`dataset_path:
json|parquet|csv` with `data_files`) and, where asked, the generation limit; prompts, few-shot sampling, filters and
metrics stay lm-eval's. The folder is kept in the run's output, so `lm_eval --include_path OUT/tasks` reproduces it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specquant.errors import SpecquantError
from specquant.gate.config import LM_EVAL_GATES, GateConfig
from specquant.gate.datasets import LocalData

# the lm-eval task folders the gates need (indexing only these, not lm-eval's ~15k tasks, saves ~10-30 s a run)
TASK_FOLDERS = {"mmlu_pro": "mmlu_pro", "ifeval": "ifeval", "gpqa_diamond": "gpqa/cot_zeroshot"}
MMLU_PRO_SUBJECT_TASK = "mmlu_pro_{}"  # category "computer science" -> mmlu_pro_computer_science


def lm_eval_tasks_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def _builtin_yaml(gate: str) -> Path:
    root = lm_eval_tasks_root() / TASK_FOLDERS[gate]
    name = {"mmlu_pro": "_mmlu_pro.yaml", "ifeval": "ifeval.yaml",
            "gpqa_diamond": "gpqa_diamond_cot_zeroshot.yaml"}[gate]
    path = root / name
    if not path.exists():
        raise SpecquantError(f"lm-eval's task file {path} is missing; reinstall the pinned lm-eval (pip install -e "
                             "'.[gate]')")
    return path


def _generation_kwargs(path: Path) -> dict:
    """The task's own generation_kwargs (an override replaces the whole dict, so start from lm-eval's)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return dict(load_yaml(path, resolve_func=False).get("generation_kwargs") or {})


def _data_override(data: LocalData) -> dict:
    return {"dataset_path": data.builder, "dataset_name": None, "dataset_kwargs": {"data_files": dict(data.files)}}


def mmlu_pro_subjects(categories: set[str]) -> list[str]:
    """Subject subtasks of lm-eval's mmlu_pro group that have test rows (a group member with none would fail)."""
    group = yaml.safe_load(_builtin_yaml("mmlu_pro").read_text())
    members = [t for t in group["task"] if t.removeprefix("mmlu_pro_").replace("_", " ") in categories]
    unknown = sorted(c for c in categories if MMLU_PRO_SUBJECT_TASK.format(c.replace(" ", "_")) not in group["task"])
    if unknown:
        raise SpecquantError(f"MMLU-Pro test split has unknown category {unknown[0]!r}; MMLU-Pro's categories are "
                             + ", ".join(t.removeprefix("mmlu_pro_").replace("_", " ") for t in group["task"]))
    return members


def write_overrides(folder: Path, gates: dict[str, LocalData], cfg: GateConfig,
                    mmlu_pro_categories: set[str] | None = None) -> dict[str, str]:
    """One YAML per gate in `folder`; returns gate -> the lm-eval task/group name to request."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for gate, data in gates.items():
        base = _builtin_yaml(gate)
        doc: dict = {"include": str(base), **_data_override(data)}
        gen = {"mmlu_pro": cfg.mmlu_pro_max_gen_toks, "ifeval": cfg.ifeval_max_gen_toks,
               "gpqa_diamond": cfg.gpqa_max_gen_toks}[gate]
        if gate == "mmlu_pro":
            # group-level keys reach every member; the member list is narrowed to the subjects present
            doc["task"] = mmlu_pro_subjects(mmlu_pro_categories or set())
            if gen is not None:
                member = base.parent / "_default_template_yaml"
                doc["generation_kwargs"] = {**_generation_kwargs(member), "max_gen_toks": gen}
        elif gen is not None:
            doc["generation_kwargs"] = {**_generation_kwargs(base), "max_gen_toks": gen}
        (folder / f"{gate}.yaml").write_text(
            f"# specquant gate {gate}: lm-eval's task on local files (generated; see docs/GATES.md)\n"
            + yaml.safe_dump(doc, sort_keys=False))
        names[gate] = LM_EVAL_GATES[gate]["task"]
    return names


def include_paths(folder: Path, gates) -> list[str]:
    """lm-eval's folders for these gates, then ours (later paths override earlier: our YAML replaces the task)."""
    root = lm_eval_tasks_root()
    return [str(root / TASK_FOLDERS[g]) for g in gates] + [str(folder)]
