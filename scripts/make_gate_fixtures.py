"""Write the gate fixtures (src/specquant/gate/fixtures): small files in the Hub datasets' own schemas.

Every item is written here (templated, seeded), not taken from the benchmarks: MMLU-Pro (TIGER-Lab/MMLU-Pro columns,
test + validation, 2 + 5 items for each of its 14 categories), IFEval (google/IFEval columns, 24 prompts) and
GPQA-Diamond (Idavidrein/gpqa columns, 24 questions). Deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "specquant" / "gate" / "fixtures"
LETTERS = "ABCDEFGHIJ"


def _numeric_item(rng, category, qid, text, answer, unit=""):
    """Ten numeric options (MMLU-Pro has up to ten), the correct one at a random position."""
    step = max(1, answer // 10)
    candidates = [answer + d * step for d in range(-4, 13) if d != 0 and answer + d * step > 0]
    wrong = set(rng.sample(candidates, 9))
    options = sorted(wrong) + [answer]
    rng.shuffle(options)
    idx = options.index(answer)
    return {"question_id": qid, "question": text, "options": [f"{o}{unit}" for o in options],
            "answer": LETTERS[idx], "answer_index": idx, "category": category, "src": "specquant-fixture"}


def _mmlu_question(rng, category):
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    table = {
        "biology": (f"A bacterium divides once every {a} hours. Starting from one cell, how many cells are there "
                    f"after {a * 3} hours?", 8, f"Three divisions double the count three times, 2^3 = 8."),
        "business": (f"A shop buys an item for {a * 10} dollars and sells it for {a * 10 + b} dollars. What is the "
                     "profit per item in dollars?", b, f"Profit is price minus cost, {a * 10 + b} - {a * 10} = {b}."),
        "chemistry": (f"A solution holds {a} moles of salt in {b} liters. How many moles are in {b * 2} liters of "
                      "the same solution?", 2 * a, f"Twice the volume holds twice the moles, 2 x {a} = {2 * a}."),
        "computer science": (f"How many bits are there in {a} bytes?", 8 * a, f"One byte is 8 bits, so {a} x 8 = "
                             f"{8 * a}."),
        "economics": (f"Output rises from {a * 100} to {a * 100 + b * 10} units. By how many units did it rise?",
                      b * 10, f"The rise is {a * 100 + b * 10} - {a * 100} = {b * 10}."),
        "engineering": (f"A pump moves {a} liters per second. How many liters does it move in {b} seconds?", a * b,
                        f"Rate times time: {a} x {b} = {a * b}."),
        "health": (f"A patient takes {a * 50} mg every 8 hours. How many mg is that per day?", a * 150,
                   f"Three doses a day: 3 x {a * 50} = {a * 150}."),
        "history": (f"A treaty signed in year {1700 + a * 10} held for {b} years. In which year did it end?",
                    1700 + a * 10 + b, f"{1700 + a * 10} + {b} = {1700 + a * 10 + b}."),
        "law": (f"A lease of {b} months starts in month 1 of year {a}. In which month of the lease does it end?",
                b, f"A {b}-month lease ends in its month {b}."),
        "math": (f"What is {a} multiplied by {b}?", a * b, f"{a} x {b} = {a * b}."),
        "other": (f"A box holds {a} items. How many full boxes do {a * b} items fill?", b,
                  f"{a * b} / {a} = {b}."),
        "philosophy": (f"A syllogism has {a} premises and one conclusion. How many statements does it have?", a + 1,
                       f"{a} premises plus 1 conclusion = {a + 1}."),
        "physics": (f"A cart moves at {a} meters per second for {b} seconds. How far does it go in meters?", a * b,
                    f"Distance is speed times time, {a} x {b} = {a * b}."),
        "psychology": (f"A study has {a * 10} participants, half in the control group. How many are in the control "
                       "group?", a * 5, f"Half of {a * 10} is {a * 5}."),
    }
    return table[category]


def mmlu_pro(rng):
    categories = ["biology", "business", "chemistry", "computer science", "economics", "engineering", "health",
                  "history", "law", "math", "other", "philosophy", "physics", "psychology"]
    splits = {"test": [], "validation": []}
    qid = 0
    for split, per in (("validation", 5), ("test", 2)):
        for cat in categories:
            for _ in range(per):
                text, answer, why = _mmlu_question(rng, cat)
                item = _numeric_item(rng, cat, qid, text, answer)
                item["cot_content"] = (f"A: Let's think step by step. {why} The answer is ({item['answer']})."
                                       if split == "validation" else "")
                splits[split].append(item)
                qid += 1
    return splits


IFEVAL_KEYS = ("num_highlights", "relation", "num_words", "num_placeholders", "prompt_to_repeat", "num_paragraphs",
               "first_word", "postscript_marker", "num_bullets", "section_spliter", "num_sections", "end_phrase",
               "keywords", "forbidden_words", "keyword", "frequency", "letter", "let_frequency", "let_relation",
               "language", "capital_frequency", "capital_relation", "nth_paragraph")


def _kw(**given):
    return {k: given.get(k) for k in IFEVAL_KEYS}


IFEVAL = [
    ("Describe a quiet harbor at dawn. Do not use any commas in your answer.",
     ["punctuation:no_comma"], [_kw()]),
    ("Write a short note to a neighbor about a lost cat. Your entire response should be in English, and in all "
     "lowercase letters. No capital letters are allowed.", ["change_case:english_lowercase"], [_kw()]),
    ("Give advice on keeping houseplants alive. Your answer must contain exactly 3 bullet points. Use markdown "
     "bullet points such as:\n* This is point 1.", ["detectable_format:number_bullet_lists"], [_kw(num_bullets=3)]),
    ("Explain why bridges have expansion joints. Answer with less than 60 words.",
     ["length_constraints:number_words"], [_kw(num_words=60, relation="less than")]),
    ("Write a story about a lighthouse keeper. Answer with at least 120 words.",
     ["length_constraints:number_words"], [_kw(num_words=120, relation="at least")]),
    ("Summarize the benefits of walking. Wrap your entire response with double quotation marks.",
     ["startend:quotation"], [_kw()]),
    ("Write a product description for a wooden chair. Finish your response with this exact phrase Is there "
     "anything else I can help with?. No other words should follow this phrase.",
     ["startend:end_checker"], [_kw(end_phrase="Is there anything else I can help with?")]),
    ("Write a poem about winter rain. Your answer must contain a title, wrapped in double angular brackets, such "
     "as <<poem of joy>>.", ["detectable_format:title"], [_kw()]),
    ("Write a letter to a friend about a trip to the mountains. At the end of your response, please explicitly "
     "add a postscript starting with P.S.", ["detectable_content:postscript"], [_kw(postscript_marker="P.S.")]),
    ("List the steps to brew tea. Your entire response should be in English, and in all capital letters.",
     ["change_case:english_capital"], [_kw()]),
    ("Describe a city market. Include the keywords lantern and copper in the response.",
     ["keywords:existence"], [_kw(keywords=["lantern", "copper"])]),
    ("Write about the ocean without using the words blue or wave.",
     ["keywords:forbidden_words"], [_kw(forbidden_words=["blue", "wave"])]),
    ("Write a short essay on gardening. In your response, the word soil should appear at least 3 times.",
     ["keywords:frequency"], [_kw(keyword="soil", frequency=3, relation="at least")]),
    ("Write a two-paragraph reply about commuting by bicycle. There should be 2 paragraphs. Paragraphs are "
     "separated with the markdown divider: ***", ["length_constraints:number_paragraphs"], [_kw(num_paragraphs=2)]),
    ("Write a plan for a weekend hike. Your response must have 2 sections. Mark the beginning of each section "
     "with SECTION X.", ["detectable_format:multiple_sections"],
     [_kw(section_spliter="SECTION", num_sections=2)]),
    ("Explain how a compass works. Highlight at least 2 sections in your answer with markdown, i.e. "
     "*highlighted section*.", ["detectable_format:number_highlighted_sections"], [_kw(num_highlights=2)]),
    ("Write a template invitation for a party. The response must contain at least 2 placeholders represented by "
     "square brackets, such as [address].", ["detectable_content:number_placeholders"],
     [_kw(num_placeholders=2)]),
    ("Describe your favourite season. Your response should contain less than 4 sentences.",
     ["length_constraints:number_sentences"], [_kw(num_sentences=4, relation="less than")]),
    ("Describe a library. Entire output should be wrapped in JSON format.", ["detectable_format:json_format"],
     [_kw()]),
    ("Is a tomato a fruit? Answer with one of the following options: My answer is yes., My answer is no., My "
     "answer is maybe.", ["detectable_format:constrained_response"], [_kw()]),
    ("Write a riddle about a clock. In your response, the letter z should appear at least 2 times.",
     ["keywords:letter_frequency"], [_kw(letter="z", let_frequency=2, let_relation="at least")]),
    ("Write a tip about saving energy. Give two different responses. Responses and only responses should be "
     "separated by 6 asterisk symbols: ******.", ["combination:two_responses"], [_kw()]),
    ("Write a slogan for a bakery. In your response, words with all capital letters should appear at least 2 "
     "times.", ["change_case:capital_word_frequency"], [_kw(capital_frequency=2, capital_relation="at least")]),
    ("Describe a garden in spring without commas. Finish your response with the exact phrase Any other "
     "questions?. Answer in all lowercase letters.",
     ["punctuation:no_comma", "startend:end_checker", "change_case:english_lowercase"],
     [_kw(), _kw(end_phrase="Any other questions?"), _kw()]),
]


def ifeval():
    rows = []
    for i, (prompt, ids, kwargs) in enumerate(IFEVAL):
        rows.append({"key": 9000 + i, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs})
    return rows


def _gpqa_question(rng, i):
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 5)
    kinds = [
        ("Physics", "Mechanics", f"A mass of {a} kg accelerates at {b} m/s^2. What net force acts on it?",
         f"{a * b} N", [f"{a + b} N", f"{a * b + c} N", f"{a * b * 2} N"], f"F = m a = {a} x {b} = {a * b} N."),
        ("Chemistry", "Stoichiometry", f"How many moles of water form when {a} moles of hydrogen gas react fully "
         "with excess oxygen?", f"{a} mol", [f"{2 * a} mol", f"{a + 1} mol", f"{a * 3} mol"],
         "2 H2 + O2 -> 2 H2O: one mole of water per mole of hydrogen."),
        ("Biology", "Genetics", f"Two heterozygous parents (Aa x Aa) have {4 * a} offspring. How many are expected "
         "to show the recessive phenotype?", f"{a}", [f"{2 * a}", f"{3 * a}", f"{a + 2}"],
         "One quarter of the offspring are aa."),
    ]
    domain, sub, q, right, wrong, why = kinds[i % len(kinds)]
    return {"Pre-Revision Question": q, "Pre-Revision Correct Answer": right,
            "Pre-Revision Incorrect Answer 1": wrong[0], "Pre-Revision Incorrect Answer 2": wrong[1],
            "Pre-Revision Incorrect Answer 3": wrong[2], "Pre-Revision Explanation": why,
            "Record ID": f"specquant-fixture-{i:03d}", "Question": q, "Correct Answer": right,
            "Incorrect Answer 1": wrong[0], "Incorrect Answer 2": wrong[1], "Incorrect Answer 3": wrong[2],
            "Explanation": why, "Subdomain": sub, "High-level domain": domain}


def gpqa_diamond(rng):
    return [_gpqa_question(rng, i) for i in range(24)]


def write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main():
    rng = random.Random(20261130)
    for split, rows in mmlu_pro(rng).items():
        write_jsonl(OUT / "mmlu_pro" / f"{split}.jsonl", rows)
    write_jsonl(OUT / "ifeval" / "train.jsonl", ifeval())
    write_jsonl(OUT / "gpqa_diamond" / "train.jsonl", gpqa_diamond(rng))
    print(f"wrote fixtures under {OUT}")


if __name__ == "__main__":
    main()
