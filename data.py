"""Prompt data: (chat messages, reference answer) records for training and evaluation.

A record is ``{"messages": [{"role": "user", "content": ...}], "answer": "..."}``; the trainer
applies the chat template to ``messages`` (`tokenize_prompts`). The paper trains on DAPO-Math-17k +
MATH levels 3-5 and evaluates on AIME 2024/2025 and AMC 2023 with the DAPO prompt (`DAPO_TEMPLATE`).
`load(name_or_path, split=, n=, seed=)` reads by name (`HUB` has the configs; docs/paper.md §4):

    dapo-math-17k  open-r1/DAPO-Math-17k-Processed     train        prompt / solution
    math-l3to5     DigitalLearningGmbH/MATH-lighteval  train, test  problem / last \\boxed{}, L3-5
    gsm8k          openai/gsm8k                        train, test  question / answer after "####"
    math500, aime24, aime25, amc23   HuggingFaceH4/MATH-500, HuggingFaceH4/aime_2024,
                   math-ai/aime25, math-ai/amc23: one Hub split, returned for any `split`;
                   problem (amc23: question) / answer
    arithmetic[:levels]            the synthetic task below, the bare problem (for the tiny model)
    arithmetic-instruct[:levels]   the same problems, asked for an "Answer: N" line (chat models)

or by path: a .parquet / .jsonl / .json file with one of these schemas or the verl schema of the
authors' files (``prompt`` = chat messages, ``reward_model.ground_truth``), or a directory of such
files named by split (data/gsm8k). A DAPO instruction already in a prompt is not doubled. Hub sets
come through `datasets`, a `huggingface_hub` snapshot or a local mirror `data_dir/<hub id>/`
(tests/fixtures/hub). Bad rows raise ValueError naming the file and the row (0-based).

    python data.py                                          # a few synthetic examples of each level
    python data.py aime24 --data-dir tests/fixtures/hub     # the records of a set
"""

import argparse
import fnmatch
import json
import os
import random
import zlib

# --- the synthetic arithmetic task ----------------------------------------------------------------
# level -> (operators, digits of a, digits of b). Level 1 is easy for the tiny model, level 4 hard.
LEVELS = {
    1: ("+-", 2, 2),  # 47+38, 91-56
    2: ("+-", 3, 3),  # 472+385
    3: ("*", 2, 1),   # 47*8
    4: ("*", 2, 2),   # 47*38
}
# a problem is held out iff crc32 of its text % HELDOUT_MOD == 0: a fixed ~10% of every level
HELDOUT_MOD = 10


def _number(rng, digits):
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _is_heldout(text):
    # A hash of the problem text, not of the seed, so train and held-out are disjoint for every seed
    # and level.
    return zlib.crc32(text.encode()) % HELDOUT_MOD == 0


def arithmetic_problem(rng, level):
    """One problem of `level` as (text, answer), e.g. ("472+385", "857")."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; known levels: {sorted(LEVELS)}")
    ops, da, db = LEVELS[level]
    op = rng.choice(ops)
    a, b = _number(rng, da), _number(rng, db)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a}{op}{b}", str(value)


# The instruction of "arithmetic-instruct": the bare problem suits the tiny model, which was taught
# the "Answer: N" format; a chat model is asked for it. A short instruction keeps prompts short, and
# prompt tokens are most of the trainer's compute here (48 tokens with SmolLM2's chat template
# against ~25 response tokens).
INSTRUCT_TEMPLATE = "What is {problem}? End with 'Answer: <number>'."


def arithmetic(n, *, split="train", levels=(1, 2, 3), seed=0, template=None):
    """`n` records of the synthetic task (levels drawn uniformly), seeded; split "train" or "test".

    The test split is the fixed held-out part of the problem space (see `_is_heldout`): a train
    record never equals a test record, whatever the seeds. template: the user turn, "{problem}"
    replaced by the problem (None: the bare problem); the problems drawn do not depend on it.
    """
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    records = []
    while len(records) < n:
        text, answer = arithmetic_problem(rng, rng.choice(levels))
        if _is_heldout(text) == (split == "test"):
            content = template.format(problem=text) if template else text
            records.append({"messages": [{"role": "user", "content": content}], "answer": answer})
    return records


def arithmetic_response(answer):
    """The completion a perfect policy writes for the synthetic task (the supervised warm start)."""
    return f"Answer: {answer}"


# --- the paper's math sets ------------------------------------------------------------------------
# The DAPO prompt, as in DAPO-Math-17k's own prompts and verl's DAPO recipe.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
_DAPO_PREFIX, _DAPO_SUFFIX = DAPO_TEMPLATE.split("{problem}")
ARITHMETIC_DEFAULT_N = 1000  # records of the synthetic task when `n` is None (it is unlimited)

# name -> (Hub id, config, {our split: Hub split}, file pattern of that split in the Hub repo,
#          row filter)
HUB = {
    "dapo-math-17k": ("open-r1/DAPO-Math-17k-Processed", "all", {"train": "train"},
                      "all/{split}-*.parquet", None),
    "math-l3to5": ("DigitalLearningGmbH/MATH-lighteval", "default",
                   {"train": "train", "test": "test"}, "data/{split}-*.parquet", "levels 3-5"),
    "gsm8k": ("openai/gsm8k", "main", {"train": "train", "test": "test"},
              "main/{split}-*.parquet", None),
    "math500": ("HuggingFaceH4/MATH-500", None, {"train": "test", "test": "test"},
                "{split}.jsonl", None),
    "aime24": ("HuggingFaceH4/aime_2024", None, {"train": "train", "test": "train"},
               "data/{split}-*.parquet", None),
    "aime25": ("math-ai/aime25", None, {"train": "test", "test": "test"}, "{split}.jsonl", None),
    "amc23": ("math-ai/amc23", None, {"train": "test", "test": "test"}, "*{split}-*.parquet", None),
}
KNOWN = ["arithmetic", "arithmetic-instruct"] + sorted(HUB)
SUFFIXES = (".parquet", ".jsonl", ".json")


def _read_file(path):
    """Rows of a local .parquet / .jsonl / .json file as dicts."""
    if path.endswith(".parquet"):
        # deferred: its import starts 2 threads, which a trainer would carry into fork()
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            rows = json.load(f)
            if not isinstance(rows, list):
                raise ValueError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
            return rows
        rows = []
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: row {len(rows)} (line {i + 1}) is not valid JSON: "
                                     f"{e}") from None
        return rows


def _hub_rows(name, split, data_dir):
    """[(row, source, index)] of a named set: through `datasets`, else a huggingface_hub snapshot,
    else the local mirror data_dir."""
    repo, config, splits, pattern, _ = HUB[name]
    if split not in splits:
        raise ValueError(f"{name} has no {split!r} split; it has {sorted(splits)}")
    hub_split = splits[split]
    if data_dir is None:
        # optional packages, tried in this order, imported here: a missing one is not an error
        try:
            import datasets
        except ImportError:
            pass
        else:
            ds = datasets.load_dataset(repo, config, split=hub_split)
            return [(dict(r), f"{repo} [{hub_split}]", i) for i, r in enumerate(ds)]
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise RuntimeError(f"loading {name!r} from the Hugging Face Hub needs `pip install "
                               f"datasets` (or huggingface_hub); or pass data_dir= a local mirror, "
                               f"or the path of a .parquet/.jsonl file with the same "
                               f"columns") from None
        try:
            root = snapshot_download(repo, repo_type="dataset",
                                     allow_patterns=[pattern.format(split=hub_split)])
        except Exception as e:  # noqa: BLE001  (no network, gated repo...: say what to do instead)
            raise RuntimeError(f"could not download {repo} from the Hub ({type(e).__name__}: {e}); "
                               f"download it elsewhere and pass data_dir=, or pass a local file "
                               f"path") from e
    else:
        root = os.path.join(data_dir, repo)
    wanted = pattern.format(split=hub_split)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                   if fnmatch.fnmatch(
                       os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"), wanted))
    if not files:
        raise FileNotFoundError(f"no file matching {wanted!r} under {root} "
                                f"(the {split} split of {name})")
    rows = []
    for path in files:
        rows.extend((r, path, i) for i, r in enumerate(_read_file(path)))
    return rows


def _strip_dapo(text):
    """The bare problem of a prompt that already carries the DAPO instruction (verl, or the original
    DAPO-Math-17k)."""
    text = text.strip()
    if text.startswith(_DAPO_PREFIX.strip()):
        text = text[len(_DAPO_PREFIX.strip()):]
    if text.rstrip().endswith(_DAPO_SUFFIX.strip()):
        text = text.rstrip()[:-len(_DAPO_SUFFIX.strip())]
    return text.strip()


def _last_boxed(text):
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _as_answer(value):
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # AMC answers are stored as floats: 27.0 -> "27"
    if isinstance(value, (int, float)):
        return str(value)
    return value.strip() if isinstance(value, str) else None


def _record(row, where, template):
    """One source row (any supported schema) -> a record; ValueError naming `where` on a bad row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a row object, got {type(row).__name__}")
    # Maxwell-Jia/AIME_2024 style "Problem"/"Answer" too
    lower = {k.lower(): v for k, v in row.items()}
    key = next((k for k in ("problem", "question", "prompt") if k in lower), None)
    if key is None:
        raise ValueError(f"{where}: no problem/question/prompt column (columns: {sorted(row)})")
    problem = lower[key]
    # verl schema: chat messages, the user turn holds the problem
    if key == "prompt" and isinstance(problem, list):
        users = [m.get("content") for m in problem
                 if isinstance(m, dict) and m.get("role") == "user"]
        problem = users[-1] if users else None
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"{where}: {key} is not a non-empty string (got {type(problem).__name__})")
    problem = _strip_dapo(problem)

    answer = None
    if "answer" in lower:
        answer = _as_answer(lower["answer"])
        # GSM8K: the worked solution ends with "#### 72"
        if answer is not None and "####" in answer:
            answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    elif isinstance(lower.get("reward_model"), dict):
        answer = _as_answer(lower["reward_model"].get("ground_truth"))
    elif "final_answer" in lower:
        answer = _as_answer(lower["final_answer"])
    elif "solution" in lower:
        answer = _as_answer(lower["solution"])
        # MATH: the answer is the last box of the solution
        if answer is not None and "\\boxed{" in answer:
            answer = _last_boxed(answer)
    if not answer:
        raise ValueError(f"{where}: missing answer (columns: {sorted(row)})")
    content = problem if template is None else template.replace("{problem}", problem)
    return {"messages": [{"role": "user", "content": content}], "answer": answer}


def _keep(row, rule):
    if rule != "levels 3-5":
        return True
    level = str(row.get("level", "")).replace("Level", "").strip()
    return level in ("3", "4", "5")


def _arithmetic_kind(name):
    """"arithmetic" or "arithmetic-instruct" for a name of the synthetic task (with levels or not),
    else ""."""
    kind = name.partition(":")[0]
    return kind if kind in ("arithmetic", "arithmetic-instruct") else ""


def split_names(names):
    """"gsm8k,arithmetic:1,3" -> ["gsm8k", "arithmetic:1,3"]: commas separate sets, except inside
    arithmetic levels."""
    out = []
    for part in filter(None, (p.strip() for p in names.split(","))):
        if part.isdigit() and out and _arithmetic_kind(out[-1]) and ":" in out[-1]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def check_name(name_or_path):
    """Raise ValueError unless `load` knows this name (or it is a readable local file); loads
    nothing."""
    name = str(name_or_path)
    if _arithmetic_kind(name):
        try:
            levels = [int(x) for x in name.partition(":")[2].split(",") if x]
        except ValueError:
            levels = [None]
        bad = [x for x in levels if x not in LEVELS]
        if bad:
            raise ValueError(f"{name!r}: arithmetic levels must be among {sorted(LEVELS)}, "
                             f"e.g. 'arithmetic:1,2'")
    elif name in HUB:
        # a Hub name wins over a local folder of the same name: --data gsm8k is always openai/gsm8k
        return
    elif os.path.isdir(name):
        if not _split_files(name):
            raise ValueError(f"directory {name!r} holds no split file "
                             f"(train/test .parquet/.jsonl/.json)")
    elif not (os.path.isfile(name) and name.endswith(SUFFIXES)):
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(KNOWN)} (arithmetic takes "
                         f"levels, e.g. 'arithmetic:1,2'), or the path of a local "
                         f".parquet/.jsonl/.json file or of a directory of such files named by "
                         f"split")


def _split_files(directory):
    """{split: path} of a local data directory: train.jsonl, test.parquet, ..."""
    out = {}
    for f in sorted(os.listdir(directory)):
        stem, ext = os.path.splitext(f)
        if ext in SUFFIXES and stem in ("train", "test", "validation"):
            out.setdefault(stem, os.path.join(directory, f))
    return out


def load(name_or_path, *, split="train", n=None, seed=0, data_dir=None, template=DAPO_TEMPLATE):
    """Records of a named set (see the module docstring), of a local .parquet/.jsonl/.json file, or
    of a local directory of such files named by split (split= picks train.jsonl, test.jsonl, ...).

    n: a seeded random subset of n rows (file order kept), all rows when None or n >= len; for
    "arithmetic" the number of generated problems (ARITHMETIC_DEFAULT_N when None). template:
    "{problem}" is replaced by the problem; None keeps the bare problem. data_dir: read named sets
    from a local mirror of their Hub repos instead.
    """
    check_name(name_or_path)
    name = str(name_or_path)
    if _arithmetic_kind(name):
        levels = tuple(int(x) for x in name.partition(":")[2].split(",") if x) or (1, 2, 3)
        instruct = INSTRUCT_TEMPLATE if _arithmetic_kind(name) == "arithmetic-instruct" else None
        return arithmetic(ARITHMETIC_DEFAULT_N if n is None else n, split=split, levels=levels,
                          seed=seed, template=instruct)
    if name in HUB:
        rows = _hub_rows(name, split, data_dir)
        rule = HUB[name][4]
    else:
        if os.path.isdir(name):
            files = _split_files(name)
            if split not in files:
                raise ValueError(f"{name!r} has no {split!r} split; it has {sorted(files)}")
            name = files[split]
        rows, rule = [(r, name, i) for i, r in enumerate(_read_file(name))], None
    records = [_record(r, f"{path}: row {i}", template) for r, path, i in rows if _keep(r, rule)]
    if n is not None and n < len(records):
        records = [records[i] for i in sorted(random.Random(seed).sample(range(len(records)), n))]
    return records


def model_task(model):
    """The task an embedded model was built for, from its bandpo.json ("" if none).

    scripts/make_tiny_model.py records "arithmetic:1,3", scripts/make_smollm2.py "data/gsm8k": a path relative to
    this repository, returned as written when it resolves from the working directory (short metric
    names: eval/data/gsm8k/...), else resolved here.
    """
    path = os.path.join(model, "bandpo.json")
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        task = json.load(f).get("task", "")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), task)
    return here if task and not os.path.exists(task) and os.path.exists(here) else task


def tokenize_prompts(records, tokenizer, max_prompt_len):
    """(prompt_ids, kept, n_dropped): the chat template applied (add_generation_prompt=True),
    too-long prompts dropped.

    The template is rendered to text and then encoded without special tokens: the template already
    places them (BOS, role markers), and this also sidesteps transformers 5's
    `apply_chat_template(tokenize=True)` returning a BatchEncoding instead of a list.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; give it one "
                         "(tokenizer.chat_template = ...)")
    # each distinct prompt once: the synthetic task's 100k draws hold ~15k-47k distinct problems,
    # and rendering the template is most of a run's start-up on a small model
    keys = [repr(r["messages"]) for r in records]
    firsts = {}
    for k, r in zip(keys, records):
        firsts.setdefault(k, r["messages"])
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m in firsts.values()]
    # ids only: the attention masks a batch call builds by default took as long as the encoding itself
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"] if texts else []
    by_key = dict(zip(firsts, encoded))
    ids = [by_key[k] for k in keys]
    prompt_ids, kept = [], []
    for r, x in zip(records, ids):
        if len(x) <= max_prompt_len:
            prompt_ids.append(list(x))
            kept.append(r)
    return prompt_ids, kept, len(records) - len(kept)


def main():
    parser = argparse.ArgumentParser(description="Print records of a prompt set.")
    parser.add_argument("name", nargs="?", default=None,
                        help=f"one of {KNOWN} or a local file (default: demo)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--n", type=int, default=3)
    parser.add_argument("--data-dir", default=None, help="local mirror of the Hub repos")
    args = parser.parse_args()
    if args.name is None:
        for level in LEVELS:
            rng = random.Random(0)
            print(level, [arithmetic_problem(rng, level) for _ in range(4)])
        print(arithmetic(3, split="test"))
        return
    try:
        records = load(args.name, split=args.split, n=args.n, data_dir=args.data_dir)
    except (ValueError, OSError, RuntimeError) as e:
        parser.error(str(e))
    for r in records:
        print(json.dumps(r, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
