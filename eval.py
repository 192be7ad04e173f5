"""Evaluation: mean@n, pass@k and maj@n on held-out prompt sets (docs/paper.md §4).

The paper evaluates on AIME 2024, AIME 2025 and AMC 2023 every 5 steps with 32 samples per problem
at temperature 1.0 and top-p 1.0, and reports mean@32 (the average accuracy over all samples) and
pass@32. train.py calls `evaluate` for its periodic validation (each rank on its shard of prompts;
`summarize` then merges the per-prompt correct counts of all ranks), and this file is also the
stand-alone command:

    python eval.py --model PATH_OR_ID --data aime24,amc23 --n 32 --temperature 1.0 [--rollout auto]

Per data set: mean@n; pass@k for k = 1, 2, 4, ... <= n (and n); maj@n (majority vote over the
extracted final answers); counts. A table goes to stdout and a JSON report to --out.

Departure from the authors' code: their pass@32 is a bootstrap "best@32"; we use the unbiased
estimator pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code"), in its numerically stable product form. Correctness is reward.is_correct
(math-verify equivalence), so mean@n may read a little higher than with the paper's exact-match
reward; pass --scorer dapo for the paper's rule.
"""

import argparse
import json
import math
import os
import sys
import time
from collections import Counter

from tqdm import tqdm

import data
import reward


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct:
    1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i).

    The product never forms the huge binomials, so it is exact to float rounding for any n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks(n):
    """The k of the pass@k table: 1, 2, 4, ... <= n, and n itself."""
    out = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return out if out[-1] == n else out + [n]


def summarize(correct_counts, n):
    """mean@n and pass@k from per-prompt correct counts (each in 0..n); nan for an empty set."""
    out = {"prompts": len(correct_counts)}
    if not correct_counts:
        return {**out, f"mean@{n}": math.nan, **{f"pass@{k}": math.nan for k in ks(n)}}
    out[f"mean@{n}"] = sum(correct_counts) / (n * len(correct_counts))
    for k in ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
    return out


def majority_correct(preds, scores):
    """maj@n for one prompt: is the most frequent extracted answer correct? Ties go to the answer
    seen first; samples without an answer do not vote; no answer at all counts as wrong."""
    keys = [None if p is None else reward.answer_key(p) for p in preds]
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(k for k in keys if k is not None and votes[k] == top)
    return scores[keys.index(winner)] > 0


def evaluate(engine, tokenizer, datasets, *, n, sampling, max_prompt_len=1024, batch_size=64,
             progress=True, scorer="math-verify"):
    """Sample n completions per prompt of every data set and score them.

    engine: anything with `.generate(prompt_ids, n, sampling)` returning len(prompt_ids) * n objects
    with `.text` (optionally `.token_ids`), grouped by prompt (rollout.py's engines). datasets:
    {name: [record]} (data.py). Returns {name: summary}, summary = `summarize(...)` plus f"maj@{n}",
    "no_answer" (fraction of samples without a final answer), "mean_tokens", "dropped" (prompts over
    max_prompt_len) and "correct_counts" (per prompt).
    """
    tokenized = {name: data.tokenize_prompts(recs, tokenizer, max_prompt_len)
                 for name, recs in datasets.items()}
    bar = tqdm(total=sum(len(t[0]) for t in tokenized.values()), desc="eval", unit="prompt",
               disable=not progress)
    results = {}
    for name, (prompt_ids, kept, dropped) in tokenized.items():
        bar.set_description(f"eval {name}")
        counts, majority, no_answer, tokens = [], [], 0, 0
        for start in range(0, len(prompt_ids), batch_size):
            chunk, recs = prompt_ids[start:start + batch_size], kept[start:start + batch_size]
            completions = engine.generate(chunk, n, sampling)
            if len(completions) != len(chunk) * n:
                raise RuntimeError(f"engine returned {len(completions)} completions for "
                                   f"{len(chunk)} prompts x {n}")
            texts = [c.text for c in completions]
            answers = [r["answer"] for r in recs for _ in range(n)]
            scores = reward.score_batch(texts, answers, correct=1.0, incorrect=0.0, scorer=scorer)
            preds = [reward.extract_answer(t) for t in texts]
            no_answer += sum(p is None for p in preds)
            tokens += sum(len(getattr(c, "token_ids", None) or ()) for c in completions)
            for i in range(len(chunk)):
                group = slice(i * n, (i + 1) * n)
                counts.append(int(sum(scores[group])))
                majority.append(majority_correct(preds[group], scores[group]))
            bar.update(len(chunk))
        samples = max(1, len(counts) * n)
        results[name] = {**summarize(counts, n),
                         f"maj@{n}": sum(majority) / len(majority) if majority else math.nan,
                         "no_answer": no_answer / samples, "mean_tokens": tokens / samples,
                         "dropped": dropped,
                         "correct_counts": counts}
    bar.close()
    return results


def format_table(results, n):
    """The results as a fixed-width text table, accuracies in percent."""
    cols = [f"mean@{n}", *[f"pass@{k}" for k in ks(n)], f"maj@{n}"]
    lines = [f"{'dataset':<16}{'prompts':>8}" + "".join(f"{c:>10}" for c in cols)
             + f"{'no-answer':>11}{'tokens':>9}"]
    for name, r in results.items():
        lines.append(f"{name:<16}{r['prompts']:>8}" + "".join(f"{100 * r[c]:>10.1f}" for c in cols)
                     + f"{100 * r['no_answer']:>10.1f}%{r['mean_tokens']:>9.0f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        description="mean@n / pass@k / maj@n of a model on prompt sets (data.py names).")
    p.add_argument("--model", default=None,
                   help="local directory or Hub id (default: rollout.DEFAULT_MODEL)")
    p.add_argument("--data", default="aime24,aime25,amc23",
                   help=f"comma-separated; names: {', '.join(data.KNOWN)}")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many prompts per data set (seeded)")
    p.add_argument("--data-dir", default=None,
                   help="local mirror of the Hub data repos (see data.py)")
    p.add_argument("--n", type=int, default=32, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64, help="prompts per engine.generate call")
    p.add_argument("--rollout", default="auto", choices=["auto", "vllm", "hf"])
    p.add_argument("--dtype", default=None,
                   help="engine dtype, e.g. bfloat16 on GPU (default: rollout.py's)")
    p.add_argument("--scorer", default="math-verify", choices=["math-verify", "dapo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON report path (default: runs/eval-<time>.json)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be >= 1")
    try:
        names = data.split_names(args.data)
        for name in names:
            data.check_name(name)
        datasets = {name: data.load(name, split=args.split, n=args.limit, seed=args.seed,
                                    data_dir=args.data_dir)
                    for name in names}
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"eval.py: error: {e}")

    import rollout  # deferred: heavy (torch, maybe vLLM), and only the command needs an engine
    from transformers import AutoTokenizer  # deferred: slow to import, only the command needs it

    model = args.model or rollout.DEFAULT_MODEL
    tokenizer = AutoTokenizer.from_pretrained(model)
    extra = {} if args.dtype is None else {"dtype": args.dtype}
    engine = rollout.make_engine(args.rollout, model, tokenizer=tokenizer, seed=args.seed,
                                 max_model_len=args.max_prompt_len + args.max_new_tokens, **extra)
    sampling = rollout.Sampling(temperature=args.temperature, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
    t0 = time.time()
    results = evaluate(engine, tokenizer, datasets, n=args.n, sampling=sampling,
                       max_prompt_len=args.max_prompt_len, batch_size=args.batch_size,
                       scorer=args.scorer)
    print(format_table(results, args.n))
    out = args.out or os.path.join("runs", time.strftime("eval-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": model, "args": vars(args), "seconds": time.time() - t0,
                   "results": results}, f, indent=1)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
