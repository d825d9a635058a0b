"""`%pagedkv record start|stop [NAME]` and `%pagedkv replay NAME --vary ...`: the notebook as a
KV-cache lab. A recording is the engine's (`engine.record`, engine/recording.py); the replay and
its table and figure are the simulator package's (sim/replay.py, sim/replay_report.py). Every
mistake is one UsageError line."""
from __future__ import annotations

import argparse
import io
import shlex
from pathlib import Path

from IPython.core.error import UsageError

_ACTIVE: dict[int, tuple[object, Path]] = {}     # id(session) -> (Recording, its file)


def trace_path(name: str) -> Path:
    """NAME -> ./NAME.jsonl; a name with a suffix or a folder is a path as given."""
    p = Path(name)
    return p if p.suffix or len(p.parts) > 1 else Path(f"{name}.jsonl")


def record(session, rest: str) -> None:
    words = shlex.split(rest)
    keep = "--keep-prompts" in words
    words = [w for w in words if w != "--keep-prompts"]
    if not words or words[0] not in ("start", "stop") or len(words) > 2:
        raise UsageError("write `%pagedkv record start [NAME] [--keep-prompts]` or `%pagedkv record stop`")
    key = id(session)
    if words[0] == "start":
        engine = session.require_engine()
        if not hasattr(engine, "record"):
            raise UsageError("a server client cannot record: `%pagedkv disconnect` and record the local engine")
        if key in _ACTIVE:
            raise UsageError(f"already recording to {_ACTIVE[key][1]}: `%pagedkv record stop` first")
        path = trace_path(words[1] if len(words) > 1 else "trace")
        try:
            _ACTIVE[key] = (engine.record(path, keep_prompts=keep), path)
        except ValueError as err:
            raise UsageError(str(err)) from None
        what = "prompt and output token ids" if keep else "lengths and block hashes, no tokens"
        print(f"recording every request to {path} ({what}); `%pagedkv record stop` writes it")
        return
    if key not in _ACTIVE:
        raise UsageError("nothing is being recorded: `%pagedkv record start NAME` first")
    recording, path = _ACTIVE.pop(key)
    trace = recording.stop()
    done = len(trace.finished)
    live = len(trace.requests) - done
    print(f"wrote {path}: {len(trace.requests)} requests ({done} finished"
          + (f", {live} still live, not replayable" if live else "")
          + (f"; {trace.header.skipped} beam searches skipped" if trace.header.skipped else "")
          + f"), {max((r.finish_step or 0 for r in trace.finished), default=0) + 1} engine steps")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="%pagedkv replay", add_help=False, exit_on_error=False)
    ap.add_argument("name")
    ap.add_argument("--vary", nargs="+", default=[], metavar="KEY=V1,V2")
    ap.add_argument("--scale", choices=("engine", "sim", "both"), default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gpus", default="1xH100")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--at", type=int, default=None, metavar="STEP")
    ap.add_argument("--out", default=None, metavar="VAR")
    ap.add_argument("--no-figure", action="store_true")
    return ap


class _Refused(Exception):
    pass


def _parse(rest: str) -> argparse.Namespace:
    ap = _parser()
    ap.error = lambda message: (_ for _ in ()).throw(_Refused(message))    # one line, never an exit
    try:
        return ap.parse_args(shlex.split(rest))
    except (_Refused, argparse.ArgumentError, ValueError) as err:
        raise UsageError(f"{err}: write `%pagedkv replay NAME [--vary KEY=V1,V2 ...] [--scale engine|sim|both] "
                         "[--model M --gpus 2xH100] [--repeat N] [--at STEP] [--out VAR]`") from None


def replay(session, shell, rest: str) -> None:
    from ..engine.trace import read_trace
    from ..sim import replay as lab
    from ..sim import replay_report
    from ..sim.trace_replay import parse_vary

    args = _parse(rest)
    engine = session.engine if hasattr(session.engine, "record") else None
    where = args.scale or ("sim" if args.model else "engine")
    try:
        trace = read_trace(trace_path(args.name))
        from ..config import EngineConfig
        arms = parse_vary(args.vary, engine.config if engine is not None else EngineConfig())
        scale = lab.SimScale(lab.find_model(args.model) if args.model else None, lab.parse_gpus(args.gpus),
                             args.repeat)
        if args.repeat < 1:
            raise ValueError(f"--repeat {args.repeat}: give a positive number of copies")
        results = lab.replay(trace, arms, where, engine, scale, args.at)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(replay_report.text(results))
    if not args.no_figure:
        from IPython.display import Image, display
        import matplotlib.pyplot as plt
        png = io.BytesIO()
        fig = replay_report.figure(results, f"{args.name}: {len(trace.finished)} requests")
        fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
        display(Image(data=png.getvalue(), format="png"))
    if args.out:
        shell.user_ns[args.out] = replay_report.table(results)
