"""What adaptive speculation's drafting steps cost and gained, per measurement.

Reads the per-step record that ``bench_e2e.py --step-record`` writes (``OUT.steps.jsonl``),
or the file a served engine writes under ``VLLM_DFLASH2_STEP_LOG=FILE``, and, for every
measurement of an adaptive engine, sets its drafting steps against plain decoding at the
same batch size (the median of that measurement's measured k = 0 steps):

  extra_s   wall time of the measured drafting steps beyond that plain cost
  saved_s   plain steps the accepted drafts made unnecessary: accepted * plain / batch
  net_s     extra_s - saved_s; > 0: drafting lost time against plain decoding

Steps that carried a prefill chunk (``measured`` false), drafting steps at a batch size
with no measured plain step in that measurement (``judged_steps`` counts the rest), and the
first step of a measurement (it spans the pause before it) are left out of all three.

    python benchmarks/step_record_summary.py benchmarks/results/e2e_cpu_adaptive_k0_record.steps.jsonl
                                             [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from statistics import median


def summarize(record: dict) -> dict:
    fields = record["step_fields"]
    steps = [dict(zip(fields, row)) for row in record["steps"]][1:]
    plain = defaultdict(list)
    for s in steps:
        if s["k"] == 0 and s["measured"]:
            plain[s["batch"]].append(s["seconds"])
    plain_at = {b: median(v) for b, v in plain.items()}
    drafting = [s for s in steps if s["k"] > 0]
    judged = [s for s in drafting if s["measured"] and s["batch"] in plain_at]
    extra = sum(s["seconds"] - plain_at[s["batch"]] for s in judged)
    saved = sum(s["accepted"] * plain_at[s["batch"]] / s["batch"] for s in judged)
    ks = defaultdict(int)
    for s in drafting:
        ks[s["k"]] += 1
    return {key: record[key] for key in ("method", "temperature", "concurrency", "round")} | {
        "steps": len(steps), "seconds": sum(s["seconds"] for s in steps),
        "drafting_steps": len(drafting), "drafting_s": sum(s["seconds"] for s in drafting),
        "judged_steps": len(judged),
        "unmeasured_s": sum(s["seconds"] for s in steps if not s["measured"]),
        "accepted": sum(s["accepted"] for s in drafting),
        "extra_s": extra, "saved_s": saved, "net_s": extra - saved,
        "k_counts": dict(sorted(ks.items())),
    }


def from_step_log(lines: list[dict]) -> list[dict]:
    """``VLLM_DFLASH2_STEP_LOG`` lines as records of the shape above: one for greedy
    steps (temperature 0), one for sampled steps (shown as 1), the estimates dropped."""
    steps = [x for x in lines if "seconds" in x]
    fields = sorted(steps[0]) if steps else []
    records = []
    for temperature, greedy in ((0.0, True), (1.0, False)):
        mine = [[s[f] for f in fields] for s in steps if s["greedy"] == greedy]
        if mine:
            records.append({"method": "step_log", "temperature": temperature,
                            "concurrency": 0, "round": 0, "step_fields": fields,
                            "steps": mine})
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps_jsonl")
    parser.add_argument("--out", help="also write the rows as JSON")
    args = parser.parse_args()
    with open(args.steps_jsonl) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if lines and "seconds" in lines[0]:  # a served engine's VLLM_DFLASH2_STEP_LOG
        lines = from_step_log(lines)
    rows = [summarize(record) for record in lines]
    print("method            T    c  r  steps  secs  drafting(s)   extra  saved    net  ks")
    for r in rows:
        print(f"{r['method']:17s} {r['temperature']:.0f} {r['concurrency']:4d} {r['round']:2d} "
              f"{r['steps']:6d} {r['seconds']:5.1f} {r['drafting_steps']:4d} ({r['drafting_s']:4.1f}) "
              f"{r['extra_s']:6.2f} {r['saved_s']:6.2f} {r['net_s']:6.2f}  {r['k_counts']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
