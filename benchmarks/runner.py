"""`mpcore bench`: mpcore against torch.multiprocessing, side by side.

The driver measures nothing itself.  For each case and each repeat it runs
two fresh child processes, one per implementation, in alternating order
(torch first on even repeats, mpcore first on odd ones), so that the two
figures of a row come from the same minutes of the same (noisy) machine.
The torch child runs cases.py by path and never imports mpcore; the mpcore
child imports it.  Each child prints one JSON line per case (cases.RESULT_TAG).
A row's figure per side is the best of its repeats (max for rates, min for
times); the JSON also keeps every value and the medians.

--quick runs every case of one side in a single child (two children in all,
per repeat, and one more for each case that wants a child of its own), with
a short timed part, to stay within ~60 s.

The spawn/process rows run a program of their own per measurement (see
cases.SPAWN_PROGRAM): `python prog.py` for torch, `mpcore run prog.py` for
mpcore.  The table says which spawn the mpcore side called.
"""
import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

from . import cases as _cases
from .cases import CASES, IMPLS, RESULT_TAG

FULL_TARGET_S = 1.0    # timed part of one measurement, full run
QUICK_TARGET_S = 0.2   # ... under --quick
REAP_GRACE_S = 2.0     # how long a finished child's descendants may linger


# --- running children -------------------------------------------------------

def _group_members(pgid):
    """Live (non-zombie) processes of process group pgid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d))
    return out


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _child_env(threads):
    env = dict(os.environ)
    # Under `mpcore run` every Python process would import mpcore at start-up
    # (mpcore.pth); the torch baseline must not.
    env.pop("MPCORE_RUN", None)
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return env


def batches(selected, quick):
    """The cases each child runs: one per case, or (quick) all of them but
    those that want a child of their own (Case.own_child), in order."""
    if not quick:
        return [[c] for c in selected]
    shared = [c for c in selected if not c.own_child]
    return ([shared] if shared else []) + [[c] for c in selected if c.own_child]


def run_child(names, impl, target_s, timeout_s, threads=None):
    """Runs cases.py for `names` on side `impl` in a new session (so that it
    and everything it starts can be killed as one group).  Returns one
    result dict per name; failures come back as {"error": ...}."""
    cmd = [sys.executable, os.path.abspath(_cases.__file__), ",".join(names), impl,
           "--target", repr(target_s)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env(threads), start_new_session=True)
    pgid = proc.pid
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(pgid)
        out, err = proc.communicate()
    except BaseException:          # KeyboardInterrupt: take the group down too
        _kill_group(pgid)
        proc.wait()
        raise
    # Reap what the child left behind (a producer it failed to join, ...).
    leftover = []
    deadline = time.monotonic() + REAP_GRACE_S
    while True:
        leftover = _group_members(pgid)
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if leftover:
        _kill_group(pgid)
    wall = time.monotonic() - t0

    results = {}
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            try:
                r = json.loads(line[len(RESULT_TAG):])
            except ValueError:
                continue
            results[r.get("case")] = r
    tail = " | ".join(l for l in err.strip().splitlines()[-3:])
    res = []
    for name in names:
        r = results.get(name)
        if r is None:
            why = (f"timed out after {timeout_s:.0f} s" if timed_out
                   else f"no result (exit code {proc.returncode})")
            r = {"case": name, "impl": impl, "error": f"{why}: {tail}" if tail else why}
        if leftover:
            r.setdefault("warnings", []).append(
                f"{len(leftover)} process(es) still alive {REAP_GRACE_S:.0f} s after the "
                f"child exited; killed")
        r["child_wall_s"] = wall
        res.append(r)
    return res


# --- aggregation --------------------------------------------------------------

def _best(values, higher_better):
    return (max if higher_better else min)(values) if values else None


def _ratio(case, t, m):
    """How many times better mpcore is than torch (>1: mpcore better)."""
    if not t or not m:
        return None
    return m / t if case.higher_better else t / m


def summarize(case, runs):
    """runs: {"torch": [result...], "mpcore": [result...]} -> a row dict."""
    row = {"name": case.name, "title": case.title, "unit": case.unit,
           "higher_better": case.higher_better, "note": case.note,
           "statistic": "best", "errors": []}
    for impl in IMPLS:
        ok = [r for r in runs[impl] if "error" not in r]
        row["errors"] += [f"{impl}: {r['error']}" for r in runs[impl] if "error" in r]
        vals = [r["value"] for r in ok]
        row[impl] = {
            "best": _best(vals, case.higher_better),
            "median": statistics.median(vals) if vals else None,
            "values": vals,
            "n": [r.get("n") for r in ok],
            "elapsed_s": [r.get("elapsed_s") for r in ok],
            "extra": [r.get("extra", {}) for r in ok],
            "repeats_ok": len(ok),
            "repeats": len(runs[impl]),
            "warnings": sorted({w for r in runs[impl] for w in r.get("warnings", [])}),
        }
    # A row with compare=False shows both figures and no ratio (dl-rss).
    row["compared"] = case.compare
    row["ratio"] = _ratio(case, row["torch"]["best"], row["mpcore"]["best"]) \
        if case.compare else None
    row["ratio_median"] = _ratio(case, row["torch"]["median"], row["mpcore"]["median"]) \
        if case.compare else None
    return row


# --- output ---------------------------------------------------------------

def fmt_value(v):
    if v is None:
        return "-"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def fmt_ratio(r):
    if r is None:
        return "-"
    return f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def format_table(rows, header_note=""):
    head = ("Case", "torch", "mpcore", "mpcore vs torch")
    lines = []
    for row in rows:
        if _columns(row) is not None:      # in a table of its own, below
            continue
        cells = [row["title"]]
        for impl in IMPLS:
            b = row[impl]["best"]
            cells.append(f"{fmt_value(b)} {row['unit']}" if b is not None else "ERROR")
        if not row.get("compared", True):
            cells.append("no ratio" if all(row[i]["best"] is not None for i in IMPLS)
                         else "FAILED")
        else:
            cells.append(fmt_ratio(row["ratio"]) if row["ratio"] is not None else "FAILED")
        lines.append(cells)
    widths = [max(len(c[i]) for c in [head] + lines) for i in range(4)]

    def fmt(c):
        return (f"{c[0]:<{widths[0]}}  {c[1]:>{widths[1]}}  {c[2]:>{widths[2]}}  "
                f"{c[3]:>{widths[3]}}")
    out = []
    if header_note:
        out.append(header_note)
    if lines:
        out += [fmt(head), "  ".join("-" * w for w in widths)]
        out += [fmt(c) for c in lines]
    out += _column_tables(rows)
    notes = []
    for row in rows:
        for line in _program_notes(row) + _case_notes(row):
            notes.append(f"  note {row['name']}: {line}")
    for row in rows:
        for e in row["errors"]:
            notes.append(f"  ERROR {row['name']}: {e}")
        for impl in IMPLS:
            for w in row[impl]["warnings"]:
                notes.append(f"  warning {row['name']} ({impl}): {w}")
    if notes:
        out.append("")
        out += notes
    return "\n".join(out)


def _columns(row):
    """The row's own columns (Case.columns), or None."""
    case = CASES.get(row["name"])
    if case is None or case.columns is None:
        return None
    try:
        return list(case.columns(row))
    except Exception as e:     # a cell must not cost the table
        return [("columns failed", f"{type(e).__name__}: {e}")]


def _column_tables(rows):
    """The rows with columns of their own (Case.columns): one table for each
    set of headers, after the main table, the rows in table order."""
    tables = {}
    for row in rows:
        cols = _columns(row)
        if cols is not None:
            tables.setdefault(tuple(h for h, _ in cols), []).append(
                [row["title"]] + [c for _, c in cols])
    out = []
    for heads, lines in tables.items():
        head = ["Case"] + list(heads)
        widths = [max(len(c[i]) for c in [head] + lines) for i in range(len(head))]
        out.append("")
        for c in [head, ["-" * w for w in widths]] + lines:
            out.append("  ".join(f"{x:<{w}}" if i in (0, len(c) - 1) else f"{x:>{w}}"
                                 for i, (x, w) in enumerate(zip(c, widths))).rstrip())
    return out


def _case_notes(row):
    """The lines a case adds under its row (Case.row_notes)."""
    case = CASES.get(row["name"])
    if case is None or case.row_notes is None:
        return []
    try:
        return list(case.row_notes(row))
    except Exception as e:     # a note must not cost the table
        return [f"(notes failed: {type(e).__name__}: {e})"]


def _program_notes(row):
    """For the rows measured in a program of their own: what the mpcore side
    called, and the program's own `import torch` (not counted)."""
    ex = {impl: [e for e in row[impl]["extra"] if "import_torch_s" in e] for impl in IMPLS}
    if not any(ex.values()):
        return []
    out = []
    impls = sorted({e[k] for e in ex["mpcore"] for k in ("spawn_impl", "process_ctx")
                    if k in e and (k == "spawn_impl") == row["name"].startswith("spawn-")})
    if impls:
        out.append("mpcore side used " + "; ".join(impls))
    imp = [f"{impl} {fmt_value(min(e['import_torch_s'] for e in ex[impl]) * 1e3)} ms"
           for impl in IMPLS if ex[impl]]
    out.append("program's own import torch (not counted): " + ", ".join(imp))
    return out


def machine_info():
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "numpy": version("numpy"),
        "mpcore": version("mpcore"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def plot_ratios(rows, path, title="mpcore vs torch.multiprocessing"):
    """Bar chart of each row's ratio (log scale, a line at 1x)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.8))
    if rows:
        xs = range(len(rows))
        ratios = [r["ratio"] for r in rows]
        colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
        bars = ax.bar(xs, ratios, color=colors)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["title"] for r in rows], rotation=30, ha="right", fontsize=8)
        for b, r in zip(bars, ratios):
            ax.annotate(fmt_ratio(r), (b.get_x() + b.get_width() / 2, r),
                        ha="center", va="bottom" if r >= 1 else "top", fontsize=8)
        lo, hi = min(ratios + [1.0]), max(ratios + [1.0])
        ax.set_ylim(lo / 2, hi * 2)
    ax.set_ylabel("mpcore / torch (higher: mpcore better)")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(rows, path):
    """GB/s of both sides for the rows that report it (Queue transfers)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["torch"]["extra"] and r["mpcore"]["extra"]
            and "GB_per_s" in r["torch"]["extra"][0]]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    w = 0.38
    for k, impl in enumerate(IMPLS):
        vals = [max(e["GB_per_s"] for e in r[impl]["extra"]) for r in rows]
        ax.bar([i + (k - 0.5) * w for i in range(len(rows))], vals, w, label=impl)
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels([r["title"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GB/s (best)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_busbw(rows, path):
    """Bus bandwidth of the all_reduce rows against message size: one line
    per (side, world size), each point the best repeat of its row.  Returns
    False (and writes nothing) when no row has the figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}   # (impl, world) -> [(bytes, busbw)]
    for r in rows:
        for impl in IMPLS:
            ex = [e for e in r[impl]["extra"] if "busbw_GBps" in e]
            if ex:
                e = max(ex, key=lambda e: e["busbw_GBps"])
                series.setdefault((impl, e["world"]), []).append((e["bytes"], e["busbw_GBps"]))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    colors = {"torch": "tab:blue", "mpcore": "tab:orange"}
    for (impl, world), pts in sorted(series.items(), key=lambda kv: (kv[0][0] != "torch",
                                                                     kv[0][1])):
        pts.sort()
        label = f"{impl} ({'gloo' if impl == 'torch' else 'shared memory'}), {world} ranks"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if world == 2 else "s",
                linestyle="-" if world == 2 else "--", color=colors[impl], label=label)
    sizes = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([f"{s >> 20} MB" if s >= 1 << 20 else f"{s >> 10} KB" for s in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("all_reduce size (float32, SUM)")
    ax.set_ylabel("bus bandwidth GB/s (best; algbw x 2(n-1)/n)")
    ax.set_title("all_reduce: torch.distributed (gloo) vs mpcore.distributed")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


BUSBW_PLOT = "allreduce-busbw.png"   # written next to --plot's file


# --- command line -------------------------------------------------------------

def select(only):
    """The cases `--only` names: a case's exact name selects that case alone
    (`shared-start`, not `shared-start-plain` too); any other string every
    case whose name or title contains it (`mpi-2r-`)."""
    if not only:
        return list(CASES.values())
    subs = [s.strip().lower() for s in only.split(",") if s.strip()]
    exact = {s for s in subs if s in CASES}
    subs = [s for s in subs if s not in exact]
    return [c for c in CASES.values()
            if c.name in exact or any(s in c.name.lower() or s in c.title.lower() for s in subs)]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="mpcore bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    ap.add_argument("--plot", metavar="FILE.png",
                    help="write a bar chart of the ratios (and, when all_reduce rows ran, "
                         f"their bus bandwidth by size to {BUSBW_PLOT} in the same folder)")
    ap.add_argument("--quick", action="store_true",
                    help="short run (~60 s): one child per side, short timed parts")
    ap.add_argument("--only", metavar="SUBSTRING,...",
                    help="run the cases named exactly, or else whose name or title "
                         "contains one of these")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="measure each side N times and keep the best (default 3; "
                         "--quick: 1)")
    ap.add_argument("--target", type=float, default=None, metavar="S",
                    help=f"seconds of each timed part (default {FULL_TARGET_S}; "
                         f"--quick: {QUICK_TARGET_S})")
    ap.add_argument("--threads", type=int, default=None, metavar="N",
                    help="set OMP_NUM_THREADS=N in the measuring children "
                         "(default: leave torch's own choice)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    return ap.parse_args(argv)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # A SIGTERM (timeout(1), a job's end) ends the run as Ctrl-C does: the
    # measuring child's session goes with it (run_child), not left running.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:14s} {c.title}  [{c.unit}]")
        return 0
    selected = select(args.only)
    if args.quick and not args.only:
        selected = [c for c in selected if c.in_quick]
    if not selected:
        print(f"mpcore bench: no case matches --only {args.only!r}; "
              f"cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    repeat = max(1, args.repeat if args.repeat is not None else (1 if args.quick else 3))
    target = args.target if args.target is not None else (
        QUICK_TARGET_S if args.quick else FULL_TARGET_S)

    info = machine_info()
    t_start = time.monotonic()
    runs = {c.name: {i: [] for i in IMPLS} for c in selected}
    for batch in batches(selected, args.quick):
        names = [c.name for c in batch]
        # The timed part is ~target per case; calibration, start-up and the
        # producers' set-up add several times that.
        timeout = sum(c.timeout_s for c in batch) + 20 * target * len(batch)
        for r in range(repeat):
            order = IMPLS if r % 2 == 0 else IMPLS[::-1]
            for impl in order:
                label = ",".join(names) if len(names) <= 2 else f"{len(names)} cases"
                print(f"  [{time.monotonic() - t_start:6.1f} s] {label} / {impl} "
                      f"({r + 1}/{repeat})", file=sys.stderr, flush=True)
                for res in run_child(names, impl, target, timeout, args.threads):
                    runs[res["case"]][impl].append(res)
    rows = [summarize(c, runs[c.name]) for c in selected]
    elapsed = time.monotonic() - t_start

    note = (f"mpcore bench{' --quick' if args.quick else ''}: best of {repeat} per side, "
            f"torch {info['torch']}, {info['nproc']} CPUs, {elapsed:.0f} s "
            f"(ratio > 1: mpcore better)")
    print(format_table(rows, note))

    failed = any(r["errors"] or (r["ratio"] is None and r["compared"])
                 or any(r[i]["best"] is None for i in IMPLS) for r in rows)
    if args.json:
        info["loadavg_end"] = list(os.getloadavg())
        doc = {"machine": info,
               "settings": {"quick": args.quick, "repeat": repeat, "target_s": target,
                            "threads": args.threads, "statistic": "best",
                            "one_child_per_side": args.quick, "elapsed_s": elapsed},
               "rows": rows, "failed": failed}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if args.plot:
        plot_ratios(rows, args.plot)
        # The all_reduce rows' bus bandwidth against size, a second file in
        # the same folder (only when such rows ran).
        plot_busbw(rows, os.path.join(os.path.dirname(os.path.abspath(args.plot)), BUSBW_PLOT))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
