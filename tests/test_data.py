"""data.py: every loader on fixture files with the real Hub schemas (tests/fixtures, written by make_fixtures.py),
the Hub path through a stand-in snapshot, bad rows and names, the DAPO template, tokenize_prompts."""

import os
import re
import sys

import pytest

import data

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
HUB = os.path.join(FIXTURES, "hub")

# name -> split -> expected (start of the bare problem, answer) per record
EXPECTED = {
    "dapo-math-17k": {"train": [("How many positive divisors", "24"), ("Find the remainder", "2"),
                                ("The sum of two numbers", "96")]},
    "math-l3to5": {"train": [("Simplify", "\\frac{3}{4}"), ("Solve $x^2=4$", "2"), ("Find all $x$", "(-1, 3)")],
                   "test": [("Compute $\\sqrt{12}$", "2\\sqrt{3}")]},
    "gsm8k": {"train": [("Tom has 3 apples", "7"), ("A shop sells", "2400")], "test": [("Ann reads", "30")]},
    "math500": {"test": [("Convert", "\\frac{1}{3}"), ("Find the interval", "(-1,1)")]},
    "aime24": {"test": [("Find the number of positive", "14"), ("Find $2^{10}", "024")]},
    "aime25": {"test": [("Find the sum of the digits", "9"), ("How many primes", "10")]},
    "amc23": {"test": [("What is $3^3$?", "27"), ("What is $1/8$", "0.125")]},
}


def _summary(records):
    return [(r["messages"][0]["content"], r["answer"]) for r in records]


@pytest.mark.parametrize("name,split", [(n, s) for n in EXPECTED for s in EXPECTED[n]])
def test_named_loader_on_fixtures(name, split):
    records = data.load(name, split=split, data_dir=HUB, template=None)
    got = _summary(records)
    assert [a for _, a in got] == [a for _, a in EXPECTED[name][split]]
    assert all(p.startswith(start) for (p, _), (start, _) in zip(got, EXPECTED[name][split]))
    for r in records:
        assert set(r) == {"messages", "answer"} and r["messages"][0]["role"] == "user"


def test_dapo_template_is_the_default():
    r = data.load("aime24", split="test", data_dir=HUB)[0]
    content = r["messages"][0]["content"]
    assert content.startswith("Solve the following math problem step by step. The last line of your response "
                              "should be of the form Answer: $Answer (without quotes)")
    assert "Find the number of positive integers" in content
    assert content.endswith('Remember to put your answer on its own line after "Answer:".')


def test_eval_sets_answer_any_split():
    """The evaluation-only sets have one Hub split, returned for train and test alike."""
    for name in ("math500", "aime24", "aime25", "amc23"):
        assert data.load(name, split="train", data_dir=HUB) == data.load(name, split="test", data_dir=HUB)
    with pytest.raises(ValueError, match="no 'test' split"):
        data.load("dapo-math-17k", split="test", data_dir=HUB)


def test_local_files_by_path():
    """Local files load by path with the same schemas, and the authors' verl parquet (DAPO instruction already
    inside the prompt) gets the template exactly once."""
    verl = data.load(os.path.join(FIXTURES, "verl_dapo.parquet"))
    hub = data.load("dapo-math-17k", data_dir=HUB)
    assert verl == hub
    assert all(r["messages"][0]["content"].count("Solve the following math problem") == 1 for r in verl)
    path = os.path.join(HUB, "HuggingFaceH4", "MATH-500", "test.jsonl")
    assert data.load(path) == data.load("math500", split="test", data_dir=HUB)
    path = os.path.join(HUB, "math-ai", "amc23", "test-00000-of-00001.parquet")
    assert [r["answer"] for r in data.load(path)] == ["27", "0.125"]


def test_hub_path_is_the_same_code(monkeypatch):
    """Without `datasets`, a named set comes from a huggingface_hub snapshot holding the repo's files; here the
    snapshot is the fixture mirror (the Hub is unreachable), so both sources must give the same records."""
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, repo_type=None, allow_patterns=None):
        calls.append((repo_id, repo_type, allow_patterns))
        return os.path.join(HUB, repo_id)

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    for name in EXPECTED:
        for split in EXPECTED[name]:
            assert data.load(name, split=split) == data.load(name, split=split, data_dir=HUB)
    assert ("openai/gsm8k", "dataset", ["main/test-*.parquet"]) in calls


def test_hub_without_libraries_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(RuntimeError, match="pip install datasets"):
        data.load("aime24")


def test_missing_mirror_file():
    with pytest.raises(FileNotFoundError, match="aime25"):
        data.load("aime25", data_dir=os.path.join(FIXTURES, "nowhere"))


@pytest.mark.parametrize("fname,message", [
    ("bad_missing_answer.jsonl", "bad_missing_answer.jsonl: row 1: missing answer"),
    ("bad_prompt_type.jsonl", "bad_prompt_type.jsonl: row 2: question is not a non-empty string"),
    ("bad_json.jsonl", "bad_json.jsonl: row 1 .* is not valid JSON"),
])
def test_bad_rows_name_file_and_row(fname, message):
    with pytest.raises(ValueError, match=message):
        data.load(os.path.join(FIXTURES, fname))


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError) as e:
        data.load("aime2024")
    for name in data.KNOWN:
        assert name in str(e.value)
    for bad in ("aime2024", "arithmetic:9", "arithmetic:x", "missing.parquet"):
        with pytest.raises(ValueError):
            data.check_name(bad)
    for good in ("arithmetic", "arithmetic:1,4", "amc23", os.path.join(FIXTURES, "verl_dapo.parquet")):
        data.check_name(good)


def test_subset_is_seeded():
    full = data.load("math-l3to5", data_dir=HUB)
    a = data.load("math-l3to5", n=2, seed=1, data_dir=HUB)
    assert a == data.load("math-l3to5", n=2, seed=1, data_dir=HUB)
    assert len(a) == 2 and all(r in full for r in a)
    subsets = {tuple(_summary(data.load("math-l3to5", n=2, seed=s, data_dir=HUB))) for s in range(10)}
    assert subsets != {tuple(_summary(a))}  # other seeds pick other rows
    assert data.load("math-l3to5", n=99, data_dir=HUB) == full


def test_arithmetic_through_load():
    records = data.load("arithmetic:1,2", n=200, seed=3)
    assert len(records) == 200
    for r in records:  # levels 1-2: 2- or 3-digit addition/subtraction
        text = r["messages"][0]["content"]
        a, b = re.split(r"[+-]", text)
        assert len(a) == len(b) in (2, 3) and str(eval(text)) == r["answer"]
    test = data.load("arithmetic", split="test", n=300)
    train = data.load("arithmetic", split="train", n=3000)
    assert len(data.load("arithmetic")) == data.ARITHMETIC_DEFAULT_N
    assert not {r["messages"][0]["content"] for r in test} & {r["messages"][0]["content"] for r in train}


def test_arithmetic_instruct_asks_the_same_problems_for_a_final_answer_line():
    """arithmetic-instruct: the problems of arithmetic (same seed, levels, split), each inside INSTRUCT_TEMPLATE."""
    for split in ("train", "test"):
        bare = data.load("arithmetic:1,4", split=split, n=50, seed=5)
        asked = data.load("arithmetic-instruct:1,4", split=split, n=50, seed=5)
        assert [r["answer"] for r in asked] == [r["answer"] for r in bare]
        for a, b in zip(asked, bare):
            problem = b["messages"][0]["content"]
            assert a["messages"][0]["content"] == f"What is {problem}? End with 'Answer: <number>'."
    assert data.split_names("arithmetic-instruct:1,3,gsm8k") == ["arithmetic-instruct:1,3", "gsm8k"]
    with pytest.raises(ValueError, match="levels must be among"):
        data.check_name("arithmetic-instruct:7")


class CharTokenizer:
    """The minimum of a HF tokenizer that tokenize_prompts uses: a chat template and __call__."""
    chat_template = "<user>{content}<assistant>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        return "<user>" + messages[0]["content"] + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, texts, add_special_tokens, return_attention_mask, return_token_type_ids):
        assert not (add_special_tokens or return_attention_mask or return_token_type_ids)
        return {"input_ids": [[ord(ch) for ch in t] for t in texts]}


def test_tokenize_prompts_filters_and_counts():
    records = [{"messages": [{"role": "user", "content": "x" * k}], "answer": "1"} for k in (1, 10, 100, 5)]
    overhead = len("<user><assistant>")
    ids, kept, dropped = data.tokenize_prompts(records, CharTokenizer(), max_prompt_len=overhead + 10)
    assert dropped == 1 and kept == [records[0], records[1], records[3]]
    assert [len(x) for x in ids] == [overhead + 1, overhead + 10, overhead + 5]
    assert "".join(map(chr, ids[0])) == "<user>x<assistant>"
    assert data.tokenize_prompts([], CharTokenizer(), 10) == ([], [], 0)
    no_template = CharTokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        data.tokenize_prompts(records, no_template, 100)


def test_tokenize_prompts_with_a_real_tokenizer():
    """transformers 5 PreTrainedTokenizerFast (char level, as the embedded tiny model): the template's special
    tokens appear once, and decoding gives the rendered template back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(i) for i in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", additional_special_tokens=specials[3:])
    tokenizer.chat_template = ("<bos>{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    records = data.load("arithmetic", n=5) + data.load("aime25", data_dir=HUB)
    ids, kept, dropped = data.tokenize_prompts(records, tokenizer, max_prompt_len=64)
    assert dropped == 2 and len(kept) == 5  # the two AIME prompts (DAPO template) are longer than 64
    for x, r in zip(ids, kept):
        assert x.count(vocab["<bos>"]) == 1 and x[-1] == vocab["<|assistant|>"]
        assert tokenizer.decode(x) == f"<bos><|user|>{r['messages'][0]['content']}<eos><|assistant|>"


def test_split_names_keeps_arithmetic_levels_whole():
    """Commas separate data sets, except the level list of the synthetic task ("arithmetic:1,3")."""
    assert data.split_names("gsm8k,arithmetic:1,3,aime24") == ["gsm8k", "arithmetic:1,3", "aime24"]
    assert data.split_names("arithmetic:1,3") == ["arithmetic:1,3"]
    assert data.split_names(" aime24 , amc23,") == ["aime24", "amc23"]
    assert data.split_names("") == []


def test_tokenize_prompts_repeated_prompts_equal_one_by_one():
    """Repeated problems (the synthetic task draws 100k of far fewer) are rendered and encoded once each: every
    record's ids equal the chat template applied and encoded for that record alone, with the real tiny tokenizer."""
    from transformers import AutoTokenizer
    import rollout
    tok = AutoTokenizer.from_pretrained(rollout.DEFAULT_MODEL)
    records = data.load("arithmetic:1", split="train", seed=0, n=20_000)
    assert len({r["messages"][0]["content"] for r in records}) < len(records)  # repeats exist
    ids, kept, dropped = data.tokenize_prompts(records, tok, 10_000)
    assert dropped == 0 and kept == records
    for r, x in zip(records, ids):
        text = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        assert x == tok(text, add_special_tokens=False)["input_ids"], r
