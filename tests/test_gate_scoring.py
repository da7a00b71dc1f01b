"""Scorer correctness: hand-checked responses, served by a loopback OpenAI-compatible stub, go through
`specquant gate --server` (lm-eval's local-completions, its own task definitions, filters and metrics); the gate's
numbers must equal the hand-computed scores and lm-eval's own per-sample scoring in its sample logs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specquant.cli import main
from specquant.gate.datasets import FIXTURES

from openai_stub import StubServer

IFEVAL_PICK = [0, 2, 3, 4, 5, 6, 7, 10, 11]
# response, strict pass, loose pass (checked by hand against lm-eval's instruction definitions)
IFEVAL_ANSWERS = {
    0: ("Sure, here it is:\nThe harbor lies still and the gulls wait.", False, True),  # comma only in line 1
    2: ("* water weekly\n* give them light\n* check the soil", True, True),  # exactly 3 bullets
    3: ("Bridges grow in heat, so joints give them room to move.", True, True),  # 11 words < 60
    4: ("A keeper watched the sea.", False, False),  # 5 words, needs >= 120
    5: ('"Walking lifts the mood."', True, True),  # wrapped in double quotes
    6: ("A sturdy oak chair. Is there anything else I can help with?", True, True),  # exact end phrase
    7: ("Rain on the roof all night.", False, False),  # no <<title>>
    10: ("Copper pots hang by a lantern.", True, True),  # both keywords
    11: ("The sea is calm and green tonight.", True, True),  # neither forbidden word
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A subset of the bundled fixtures: MMLU-Pro math (2 test items) + physics (1), 9 IFEval prompts, 4 GPQA."""
    root = tmp_path_factory.mktemp("gate-data")
    test = _rows(FIXTURES / "mmlu_pro" / "test.jsonl")
    math = [r for r in test if r["category"] == "math"][:2]
    physics = [r for r in test if r["category"] == "physics"][:1]
    _write(root / "mmlu_pro" / "test.jsonl", math + physics)
    _write(root / "mmlu_pro" / "validation.jsonl", _rows(FIXTURES / "mmlu_pro" / "validation.jsonl"))
    ifeval = _rows(FIXTURES / "ifeval" / "train.jsonl")
    _write(root / "ifeval" / "train.jsonl", [ifeval[i] for i in IFEVAL_PICK])
    _write(root / "gpqa_diamond" / "train.jsonl", _rows(FIXTURES / "gpqa_diamond" / "train.jsonl")[:4])
    return root, math + physics, [ifeval[i] for i in IFEVAL_PICK], _rows(FIXTURES / "gpqa_diamond" / "train.jsonl")[:4]


def _scripted(mmlu, ifeval, gpqa):
    """The stub's answers. MMLU-Pro (regex 'answer is \\(?([A-J])\\)?', first match): math#1 correct, math#2 a wrong
    letter without parentheses, physics#1 'answer is (Z)' then the right letter (first valid match counts:
    correct). So math 1/2, physics 1/1: unweighted mean 0.75 (weighted 2/3).
    GPQA flexible-extract (last '(X)' in the answer): #1 correct, #2 a wrong choice then the right one (correct),
    #3 the right one then a wrong one (wrong), #4 no letter (wrong): 0.5."""
    by_question = {r["question"]: r for r in mmlu}
    ifeval_answers = {ifeval[i]["prompt"]: IFEVAL_ANSWERS[k][0] for i, k in enumerate(IFEVAL_PICK)}
    gpqa_rows = {r["Question"]: (n, r) for n, r in enumerate(gpqa)}

    def respond(prompt, max_tokens, stop):
        if prompt in ifeval_answers:
            return ifeval_answers[prompt]
        if prompt.startswith("What is the correct answer to this question:"):
            question = prompt.split("question:", 1)[1].split("\nChoices:")[0]
            n, row = gpqa_rows[question]
            letters = dict(re.findall(r"\(([A-D])\) (.*)", prompt))
            right = next(k for k, v in letters.items() if v == row["Correct Answer"])
            wrong = next(k for k in "ABCD" if k != right)
            return [f"Compute it. The answer is ({right}).", f"Not ({wrong}); the answer is ({right})",
                    f"First ({right}), but on reflection ({wrong}).", "I cannot tell."][n]
        question = prompt.rsplit("Question:\n", 1)[1].split("\nOptions:")[0]
        row = by_question[question]
        wrong = next(c for c in "ABCDEFGHIJ" if c != row["answer"])
        plan = {0: f" It is simple arithmetic, so the answer is ({row['answer']}).",
                1: f" The answer is {wrong}.",
                2: f" Maybe the answer is (Z). No: the answer is ({row['answer']})."}
        return plan[mmlu.index(row)] + "\n\nQuestion: next"  # text after the stop sequence is cut

    return respond


def test_gate_scores_equal_hand_checked_and_lm_eval(data_dir, tmp_path, capsys):
    root, mmlu, ifeval, gpqa = data_dir
    thresholds = tmp_path / "thr.json"
    # IFEval's instruction-level strict accuracy is 6/9 = 0.667 < 0.7: that gate fails, the others pass
    thresholds.write_text(json.dumps({"mmlu_pro": {"min": 0.7}, "ifeval": {"min": 0.7}, "gpqa_diamond": {"min": 0.5}}))
    out = tmp_path / "out"
    with StubServer(_scripted(mmlu, ifeval, gpqa)) as server:
        code = main(["gate", "--server", server.url, "--model-name", "stub", "--tasks", "mmlu_pro,ifeval,gpqa_diamond",
                     "--data-dir", str(root), "--thresholds", str(thresholds), "--out", str(out), "--json"])
        assert server.requests, "lm-eval never called the server"
        assert all(r["model"] == "stub" for r in server.requests)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1 and summary["exit_code"] == 1
    gates = {g["gate"]: g for g in summary["gates"]}
    assert gates["mmlu_pro"]["value"] == pytest.approx(0.75) and gates["mmlu_pro"]["passed"]
    assert gates["gpqa_diamond"]["value"] == pytest.approx(0.5) and gates["gpqa_diamond"]["passed"]
    strict = sum(v[1] for v in IFEVAL_ANSWERS.values()) / len(IFEVAL_ANSWERS)
    loose = sum(v[2] for v in IFEVAL_ANSWERS.values()) / len(IFEVAL_ANSWERS)
    assert gates["ifeval"]["value"] == pytest.approx(strict) == pytest.approx(6 / 9) and not gates["ifeval"]["passed"]
    lm = summary["lm_eval"]["model"]["results"]
    assert lm["ifeval"]["prompt_level_strict_acc,none"] == pytest.approx(strict)  # one instruction per prompt here
    assert lm["ifeval"]["inst_level_loose_acc,none"] == pytest.approx(loose)
    assert lm["mmlu_pro"]["exact_match,custom-extract"] == pytest.approx(2 / 3)  # lm-eval's size-weighted group mean

    # lm-eval's own sample logs hold the same per-sample verdicts
    samples = {p.name.split("_20")[0]: [json.loads(x) for x in p.read_text().splitlines()]
               for p in (out / "model").rglob("samples_*.jsonl")}
    by_prompt = {s["doc"]["prompt"]: s for s in samples["samples_ifeval"]}
    for i, k in enumerate(IFEVAL_PICK):
        s = by_prompt[ifeval[i]["prompt"]]
        assert s["resps"][0][0] == IFEVAL_ANSWERS[k][0]
        assert (s["prompt_level_strict_acc"], s["prompt_level_loose_acc"]) == IFEVAL_ANSWERS[k][1:], k
    gpqa_filtered = [s for s in samples["samples_gpqa_diamond_cot_zeroshot"] if s["filter"] == "flexible-extract"]
    assert sorted(s["exact_match"] for s in gpqa_filtered) == [0.0, 0.0, 1.0, 1.0]
    wrong_letter = next(c for c in "ABCDEFGHIJ" if c != mmlu[1]["answer"])
    math = {s["doc"]["question"]: s for s in samples["samples_mmlu_pro_math"]}
    assert math[mmlu[0]["question"]]["filtered_resps"][0] == mmlu[0]["answer"]
    assert math[mmlu[1]["question"]]["filtered_resps"][0] == wrong_letter  # 'answer is C' without parentheses
    (physics,) = samples["samples_mmlu_pro_physics"]
    assert physics["filtered_resps"][0] == mmlu[2]["answer"] and physics["exact_match"] == 1.0
    assert (out / "gates.md").read_text().count("FAIL") == 1
    assert (out / "tasks" / "gpqa_diamond.yaml").exists()


def test_server_path_matches_the_specquant_backend(tmp_path, capsys):
    """The same model behind a loopback OpenAI-compatible server (our engine, greedy) and through the `specquant`
    backend: lm-eval gets the same responses and the gate the same scores."""
    from specquant.decode.sampling import SamplingConfig
    from specquant.gate.engine import EvalEngine

    engine = EvalEngine("tiny-target")

    def respond(prompt, max_tokens, stop):
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        new, _ = engine.generate(ids, max_tokens, SamplingConfig())
        return engine.tokenizer.decode(new, skip_special_tokens=True)

    thresholds = tmp_path / "thr.json"
    thresholds.write_text(json.dumps({"ifeval": {"min": 0.0}}))
    common = ["--tasks", "ifeval", "--limit", "2", "--ifeval-max-gen-toks", "16", "--thresholds", str(thresholds),
              "--json"]
    assert main(["gate", "--model", "tiny-target", "--out", str(tmp_path / "local"), *common]) == 0
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with StubServer(respond) as server:
        assert main(["gate", "--server", server.url, "--model-name", "tiny", "--out", str(tmp_path / "served"),
                     *common]) == 0
        assert [r["max_tokens"] for r in server.requests] == [16, 16]
    served = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert served["lm_eval"]["model"]["results"]["ifeval"] == local["lm_eval"]["model"]["results"]["ifeval"]

    def responses(folder):
        (path,) = (tmp_path / folder / "model").rglob("samples_ifeval_*.jsonl")
        return [json.loads(x)["resps"] for x in path.read_text().splitlines()]

    assert responses("served") == responses("local")
    assert any(r[0][0].strip() for r in responses("local"))  # the model said something
