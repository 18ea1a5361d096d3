"""A 100,000-row dataset as a task: load time, memory, and a resume at row 50,000 (asyncrl/datasets.py).

    python benchmarks/bench_dataset.py                      # 100k rows in every format, resume at 50,000
    python benchmarks/bench_dataset.py --rows 20000 --resume-at 10000 --name small

Rows are word problems with three more columns (an answer, an operation, a list of numbers), written once as
JSONL (standard and conversational prompts), JSON, Parquet, CSV and a ``datasets`` save directory. Each format
is measured in a fresh process (so its memory is its own): ``dataset_task(train=FILE, eval_fraction=0.01)``
(read, check every row, build the prompts, hash the file), the same call again (the cached task the controller
gets after the config checked it), the controller's work on it with the byte tokenizer (render conversational
prompts through the chat template and check every prompt's length), the resident memory it keeps and its peak,
and the resume: a new process that builds the task and the prompt stream and serves positions 50,000.. (what a
restore does before the first dispatch), checked against the prompts an uninterrupted stream serves there. Then
the real thing on the JSONL file: a controller (simulated backends) stepped past row 50,000, saved, and restored
in a new process by ``Controller.restore``, whose next two steps dispatch the prompts the uninterrupted run did.
Raw rows and results go to ``benchmarks/data/bench_dataset/<name>/`` (benchmarks/record.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record import meta, save  # noqa: E402

FORMATS = ["jsonl", "jsonl_conversational", "json", "parquet", "csv", "saved"]


def _rows(n: int, conversational: bool = False) -> list[dict]:
    import random

    rng = random.Random(0)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        text = f"Problem {i}: Ann has {a} apples and gets {b} more. How many apples does she have?"
        prompt = [{"role": "user", "content": text}] if conversational else text
        out.append({"prompt": prompt, "answer": str(a + b), "op": "add", "nums": [a, b]})
    return out


def _write(fmt: str, rows: int, directory: Path) -> Path:
    conversational = fmt == "jsonl_conversational"
    data = _rows(rows, conversational)
    if fmt in ("jsonl", "jsonl_conversational"):
        path = directory / f"{fmt}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    elif fmt == "json":
        path = directory / "rows.json"
        path.write_text(json.dumps(data))
    elif fmt == "csv":
        import pandas as pd

        path = directory / "rows.csv"
        pd.DataFrame([{k: v for k, v in r.items() if k != "nums"} for r in data]).to_csv(path, index=False)
    else:
        import datasets

        ds = datasets.Dataset.from_list(data)
        if fmt == "parquet":
            path = directory / "rows.parquet"
            ds.to_parquet(str(path))
        else:
            path = directory / "saved"
            ds.save_to_disk(str(path))
    return path


def _memory_mb() -> tuple[float, float]:
    """(resident, peak resident) of this process, MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(path: str, resume_at: int) -> dict:
    """In this (fresh) process: load, load again, render and check, memory (see the module docstring)."""
    from asyncrl.chat import check_prompt_lengths, render_task
    from asyncrl.datasets import dataset_task
    from asyncrl.prompts import PromptStream
    from asyncrl.tokenizer import build_tokenizer

    import datasets  # noqa: F401  (the readers' imports are not the load's cost, nor its memory)
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    tokenizer = build_tokenizer()
    rss0, _ = _memory_mb()
    start = time.perf_counter()
    task = dataset_task(train=path, eval_fraction=0.01)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    again = dataset_task(train=path, eval_fraction=0.01)
    cached_s = time.perf_counter() - start
    assert again is task
    start = time.perf_counter()
    rendered = render_task(task, tokenizer)
    check_prompt_lengths(rendered, tokenizer, 1 << 16, 8, "model.max_position_embeddings")
    render_s = time.perf_counter() - start
    rss1, peak = _memory_mb()
    stream = PromptStream(rendered.train_prompts, seed=0)
    expected = [p.id for p in stream.take(resume_at, 64)]
    return {"rows": len(task.train_prompts) + len(task.eval_prompts), "load_s": load_s, "cached_s": cached_s,
            "render_and_check_s": render_s, "rss_kept_mb": rss1 - rss0, "peak_rss_mb": peak - rss0,
            "expected": expected}


def resume(path: str, resume_at: int) -> dict:
    """A new process that continues at ``resume_at``: build the task and the stream, serve the next 64."""
    from asyncrl.chat import render_task
    from asyncrl.datasets import dataset_task
    from asyncrl.prompts import PromptStream
    from asyncrl.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    start = time.perf_counter()
    task = render_task(dataset_task(train=path, eval_fraction=0.01), tokenizer)
    stream = PromptStream(task.train_prompts, seed=0)
    built = time.perf_counter()
    served = [p.id for p in stream.take(resume_at, 64)]
    return {"resume_build_s": built - start, "resume_first_batch_s": time.perf_counter() - built, "served": served}


def _controller_config(path: str, extra: dict | None = None):
    """The real controller, buffer and sampler over the dataset, on the simulated backends (no model: getting to
    row 50,000 is ~800 steps), ``in_order`` without lookahead so the schedule does not depend on timing."""
    from asyncrl import load_config

    return load_config("what_if", groups_per_step=64, group_size=2, sampler={"name": "in_order",
                       "max_lookahead_versions": 0}, task={"name": "dataset", "options": {"train": path,
                       "eval_fraction": 0.01}}, generation={"max_new_tokens": 4}, **(extra or {}))


def controller_resume(path: str, resume_at: int, work: Path) -> dict:
    """Step a controller until its data position passes ``resume_at``, save, go on two steps; then a fresh process
    restores the checkpoint (task, backends, state) and runs the same two steps: the same prompts, timed."""
    from asyncrl import Controller

    ctrl = Controller.from_config(_controller_config(path))
    start = time.perf_counter()
    while ctrl.data_position < resume_at:
        ctrl.tick()
    reach_s = time.perf_counter() - start
    T, position = ctrl.trainer_version, ctrl.data_position
    ckpt = ctrl.save(work / "ckpt")
    seen = len(ctrl.trace)
    while ctrl.trainer_version < T + 2:
        ctrl.tick()
    trace = ctrl.trace.iloc[seen:]
    expected = trace[trace.event == "dispatch"].detail.tolist()
    back = _child("restore", str(ckpt), T + 2)
    return {"controller_steps": T, "controller_position": position, "reach_s": reach_s,
            "checkpoint_mb": sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20, "restore_s": back["restore_s"],
            "restored_position": back["position"], "controller_resume_matches": back["dispatched"] == expected}


def restore(ckpt: str, until: int) -> dict:
    from asyncrl import Controller

    start = time.perf_counter()
    ctrl = Controller.restore(ckpt)
    restore_s = time.perf_counter() - start
    position, seen = ctrl.data_position, len(ctrl.trace)
    while ctrl.trainer_version < until:
        ctrl.tick()
    trace = ctrl.trace.iloc[seen:]
    return {"restore_s": restore_s, "position": position,
            "dispatched": trace[trace.event == "dispatch"].detail.tolist()}


def _child(mode: str, path: str, resume_at: int) -> dict:
    out = subprocess.run([sys.executable, __file__, f"--{mode}", path, "--resume-at", str(resume_at)],
                         capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--resume-at", type=int, default=50_000)
    parser.add_argument("--formats", nargs="*", default=FORMATS, choices=FORMATS)
    parser.add_argument("--name", default=None, help="run directory name under benchmarks/data/bench_dataset")
    parser.add_argument("--out", default=None, help="write rows.csv/meta.json here instead")
    parser.add_argument("--measure", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--resume", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--restore", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--no-controller", action="store_true", help="skip the controller's save and restore")
    args = parser.parse_args()
    if args.measure or args.resume or args.restore:
        if args.restore:
            result = restore(args.restore, args.resume_at)
        else:
            result = measure(args.measure, args.resume_at) if args.measure else resume(args.resume, args.resume_at)
        print(json.dumps(result))
        return
    before = meta("bench_dataset")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats:
            path = _write(fmt, args.rows, Path(scratch))
            size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
            got = _child("measure", str(path), args.resume_at)
            back = _child("resume", str(path), args.resume_at)
            expected, served = got.pop("expected"), back.pop("served")
            rows.append({"format": fmt, "file_mb": size / 2**20, **got, **back,
                         "resume_matches": served == expected})
            print(f"{fmt:>22}: {got['load_s']:.2f} s load, {got['rss_kept_mb']:.0f} MB kept", flush=True)
        if not args.no_controller:
            path = Path(scratch) / "jsonl.jsonl"
            if not path.exists():
                _write("jsonl", args.rows, Path(scratch))
            run = controller_resume(str(path), args.resume_at, Path(scratch))
            print(f"\ncontroller: {run['controller_steps']} steps to data position {run['controller_position']:,} "
                  f"({run['reach_s']:.0f} s, simulated backends); checkpoint {run['checkpoint_mb']:.1f} MB; "
                  f"Controller.restore in a new process {run['restore_s']:.1f} s (reads and checks the {args.rows:,} rows "
                  f"again); the next two steps' prompts the same: {run['controller_resume_matches']}")
    print(f"\n{args.rows:,} rows, resume at row {args.resume_at:,} (load average {before['machine']['load_1min']} "
          f"on {before['machine']['cores']} cores before the run)")
    print(f"{'format':>22} {'file MB':>8} {'load s':>7} {'cached s':>9} {'render+check s':>15} {'kept MB':>8} "
          f"{'peak MB':>8} {'resume s':>9} {'same rows':>9}")
    for r in rows:
        print(f"{r['format']:>22} {r['file_mb']:8.1f} {r['load_s']:7.2f} {r['cached_s']:9.4f} "
              f"{r['render_and_check_s']:15.2f} {r['rss_kept_mb']:8.0f} {r['peak_rss_mb']:8.0f} "
              f"{r['resume_build_s'] + r['resume_first_batch_s']:9.2f} {str(r['resume_matches']):>9}")
    results = {"rows": args.rows, "resume_at": args.resume_at, "all_resumes_match": all(r["resume_matches"] for r in rows),
               "max_load_s": max(r["load_s"] for r in rows), "max_rss_kept_mb": max(r["rss_kept_mb"] for r in rows),
               **({} if args.no_controller else run)}
    print(f"\nsaved to {save('bench_dataset', rows, results, before=before, out=args.out, name=args.name)}")


if __name__ == "__main__":
    main()
