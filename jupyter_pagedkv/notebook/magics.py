"""`%pagedkv`, `%%generate` and `%%chat`: the notebook front of one persistent engine.

Options are parsed with IPython's magic_arguments, so `%pagedkv?`, `%%generate?` and `%%chat?`
show them all. A user mistake is one UsageError line that says what to do, never a traceback.
"""
from __future__ import annotations

import logging
import shlex
import subprocess
import sys

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..config import EngineConfig, changed_flags, format_bytes, from_arguments
from ..protocol import EngineUnavailable
from .session import NO_ENGINE, KernelSession, current
from .options import (SESSION_NAME, generate_params, interpolate, kept_output, load_arguments, parse_connect,
                      parse_line, sampling_arguments, sampling_params, split_prompts)
from .tenants import set_tenant_line, tenants_table
from .text_views import block_map, requests_table
from .cell_runner import CellRunner, show_logprobs
from .streaming import CellRun

logger = logging.getLogger(__name__)

COMMANDS = ("load", "unload", "status", "requests", "tenants", "why", "reset-cache", "monitor", "bench", "plan",
            "help")
HELP = """\
jupyter-pagedkv magics (one engine per kernel, shared by every cell):
  %pagedkv load [MODEL] [options]   load a model (default: the embedded SmolLM2-135M-Instruct)
  %pagedkv status                   model, KV cache and engine gauges
  %pagedkv requests                 live and recent requests, chat sessions, background jobs
  %pagedkv tenants                  per tenant: blocks held, share, queue, TTFT and end-to-end tails
  %pagedkv tenant NAME [--weight W] [--max-blocks N]
                                    a tenant's weight in the fair share (load --scheduling-policy
                                    fair) and its hard cap on blocks held
  %pagedkv why [REQ]                why each prompt block of a request (default: the last one) hit
                                    the prefix cache or not: where it differs, evicted (when, by
                                    whom), another tenant's salt, another model, partial block...
  %pagedkv monitor                  the live block-pool widget (text outside a notebook)
  %pagedkv reset-cache              drop cached prefixes (blocks not in use)
  %pagedkv unload                   release the model and the KV memory
  %pagedkv bench NAME [...]         run `python -m jupyter_pagedkv.bench NAME ...` in a subprocess
                                    (its plots are shown here), e.g. `%pagedkv bench tail --scale sim`
  %pagedkv plan MODEL [--gpu G] [--num-gpus N] [--context N] [--kv-cache-dtype auto|fp8_e4m3|int8]
                                    KV capacity: bytes per token, tokens that fit, paged vs contiguous
  %pagedkv connect URL [--api-key-env NAME] [--model NAME] [--kv-events tcp://HOST:PORT] [--timeout S]
                                    stream %%generate / %%chat from a vLLM server; status and monitor
                                    read its /metrics (and its KV events); the key comes from
                                    $NAME, else $VLLM_API_KEY, else $OPENAI_API_KEY (--api-key KEY
                                    works but is saved in the notebook)
  %pagedkv disconnect               back to the kernel's own engine
  %pagedkv record start|stop [NAME] [--keep-prompts]
                                    record every request to NAME.jsonl (lengths and block hashes;
                                    --keep-prompts: token ids too)
  %pagedkv replay NAME [--vary KEY=V1,V2 ...] [--scale engine|sim|both] [--model M --gpus 2xH100]
                    [--repeat N] [--at STEP] [--out VAR]
                                    replay a recording under each combination (allocator, scheduling,
                                    block_size, prefix_caching, preemption): one table, one figure
  %%generate [options]              generate from the cell; `---` lines separate concurrent prompts,
                                    {name} inserts a variable ({{ and }} are literal braces)
  %%chat [SESSION] [options]        one turn of a multi-turn chat; earlier turns stay in the KV cache
All options: %pagedkv?  %%generate?  %%chat?"""


@magics_class
class PagedKVMagics(Magics):
    """Magics over the kernel's one engine (`jupyter_pagedkv.notebook.session.current()`)."""

    @property
    def session(self) -> KernelSession:
        return current()

    @property
    def _cells(self) -> CellRunner:
        return CellRunner(self.shell, self.session)

    # -- %pagedkv -------------------------------------------------------------------------------
    @magic_arguments()
    @argument("command", nargs="?", default="help", choices=COMMANDS, metavar="COMMAND",
              help="load | unload | status | requests | tenants | why | reset-cache | monitor | bench | plan | help")
    @argument("model", nargs="?", default=None, metavar="MODEL",
              help="load: a Hugging Face model folder or cached id (default: embedded SmolLM2-135M-Instruct)")
    @load_arguments
    @line_magic
    def pagedkv(self, line: str) -> None:
        """Load, inspect and release the kernel's paged KV-cache engine. `%pagedkv help` for a tour."""
        words = line.split(None, 1)
        if words and words[0] in ("bench", "plan", "connect", "disconnect", "tenant", "why", "record", "replay"):
            return getattr(self, "_" + words[0])(words[1] if len(words) > 1 else "")
        args = parse_line(self.pagedkv, line)
        if args.command != "load":
            given = changed_flags(args)
            if given or args.model is not None:
                what = ", ".join(given) or repr(args.model)
                raise UsageError(f"{what} only applies to `%pagedkv load`")
        getattr(self, "_" + args.command.replace("-", "_"))(args)

    def _help(self, args) -> None:
        print(HELP)

    def _load(self, args) -> None:
        if args.num_blocks is not None and args.kv_cache_memory is not None:
            raise UsageError("give --num-blocks or --kv-cache-memory, not both")
        kwargs = from_arguments(args)
        try:
            EngineConfig(**kwargs)
        except (ValueError, TypeError) as err:
            raise UsageError(f"cannot load: {err}") from None
        replaced = self.session.engine is not None
        try:
            self.session.load(args.model, **kwargs)
        except (ValueError, RuntimeError) as err:   # unknown model, bad dtype, a pool too small...
            unloaded = replaced and self.session.engine is None      # the preflight failing unloads nothing
            note = " (the previous model was unloaded first)" if unloaded else ""
            raise UsageError(f"cannot load: {err}{note}") from None
        print(f"loaded {self.session.summary_line()} [{self.session.load_seconds:.1f} s]")

    def _unload(self, args) -> None:
        if self.session.engine is None:
            print("no model loaded: nothing to unload")
            return
        name = self.session.engine.name
        before, after = self.session.unload()
        base = self.session.rss_before_load
        print(f"unloaded {name}: process memory {format_bytes(before)} → {format_bytes(after)} "
              f"({format_bytes(base)} with torch imported, before the first model was loaded)")

    def _status(self, args) -> None:
        s = self.session
        if s.engine is None:
            print(NO_ENGINE)
            return
        e, info = s.engine, s.engine.info()
        print(info.summary)
        if info.kv_phrase:
            print(info.kv_phrase)
        if info.plan:           # a local engine: which code runs its steps, and why
            print("execution plan:\n" + "\n".join(f"  {line}" for line in info.plan))
        print(e.stats().summary())
        print(f"engine thread: {'running' if e.is_running else 'stopped'}; background jobs: "
              f"{len(s.live_jobs())} running; chat sessions: {len(s.chats)}")

    def _requests(self, args) -> None:
        engine = self.session.require_engine()
        print(requests_table(self.session, engine))

    def _tenants(self, args) -> None:
        print(tenants_table(self.session.require_engine().stats()))

    def _tenant(self, line: str) -> None:
        try:
            print(set_tenant_line(self.session.require_engine(), line))
        except ValueError as err:
            raise UsageError(str(err)) from None

    def _why(self, rest: str) -> None:
        words = rest.split()
        if len(words) > 1:
            raise UsageError("usage: %pagedkv why [REQUEST_ID] (the ids %pagedkv requests lists; default: the last)")
        try:
            print(self.session.require_engine().why(words[0] if words else None))
        except ValueError as err:
            raise UsageError(str(err)) from None

    def _reset_cache(self, args) -> None:
        n = self.session.require_engine().reset_prefix_cache()
        print(f"prefix cache cleared: {n} cached block{'s' if n != 1 else ''} dropped")

    def _monitor(self, args) -> None:
        """In a kernel: the live widget (which also works in Notebook 7 and VS Code). Elsewhere,
        or without anywidget: the pool as text."""
        engine = self.session.require_engine()
        if getattr(self.shell, "kernel", None) is not None:
            try:
                monitor = engine.monitor()
            except ImportError:
                pass
            else:
                from IPython.display import display
                display(monitor)
                return
        print(engine.stats().summary())
        print(block_map(engine.pool_snapshot()))

    def _bench(self, rest: str) -> None:
        """Benchmarks load their own engines, so they run in a subprocess with their output here."""
        cmd = [sys.executable, "-m", "jupyter_pagedkv.bench", *shlex.split(rest)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        plots = []
        try:
            for text in proc.stdout:
                print(text, end="")
                if text.strip().startswith("plot: "):
                    plots.append(text.strip()[len("plot: "):])
            proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        if proc.returncode:
            raise UsageError(f"the benchmark exited with status {proc.returncode}")
        from IPython.display import Image, display
        for path in plots:
            display(Image(filename=path))

    def _connect(self, rest: str) -> None:
        """Hand the magics a server client; the local engine stays loaded for `disconnect`."""
        args = parse_connect(rest)
        try:
            client = self.session.connect(args.url, api_key=args.api_key, api_key_env=args.api_key_env,
                                          model=args.model,
                                          timeout=args.timeout, kv_events=args.kv_events,
                                          kv_events_topic=args.kv_events_topic)
        except (EngineUnavailable, ValueError) as err:
            raise UsageError(f"cannot connect: {err}") from None
        local = self.session.local_engine
        print(f"connected to {client.name}" + (f" (vLLM {client.version})" if client.version else "")
              + "; %%generate and %%chat now run there"
              + (f"; `%pagedkv disconnect` returns to {local.name}" if local is not None else ""))

    def _disconnect(self, rest: str) -> None:
        if rest.strip():
            raise UsageError("`%pagedkv disconnect` takes no arguments")
        client = self.session.disconnect()
        if client is None:
            print("not connected to a server: nothing to disconnect")
            return
        back = self.session.engine
        print(f"disconnected from {client.name}; "
              + (f"back to {back.name}" if back is not None else "no local model loaded (`%pagedkv load`)"))

    def _record(self, rest: str) -> None:
        from .lab import record
        record(self.session, rest)

    def _replay(self, rest: str) -> None:
        from .lab import replay
        replay(self.session, self.shell, rest)

    def _plan(self, rest: str) -> None:
        """The capacity planner in-process (it is arithmetic), with its concurrency plot."""
        import contextlib
        import io

        from ..sim import plan as planner

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                p = planner.from_argv(shlex.split(rest))
        except SystemExit as exit_:
            lines = err.getvalue().strip().splitlines()
            if exit_.code == 0:   # --help
                print(err.getvalue().replace("python -m jupyter_pagedkv plan", "%pagedkv plan"))
                return
            raise UsageError(f"{lines[-1] if lines else 'bad arguments'} (e.g. %pagedkv plan "
                             f"Llama-3-70B --gpu H100-80GB --num-gpus 2)") from None
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(p.summary())
        if p.fits:
            # As PNG bytes, not the Figure: a bare Figure only renders where pyplot's inline
            # backend is already active, and shows as "<Figure ...>" text everywhere else.
            from IPython.display import Image, display
            png = io.BytesIO()
            planner.figure(p).savefig(png, format="png", dpi=100, bbox_inches="tight")
            display(Image(data=png.getvalue(), format="png"))

    # -- %%generate ---------------------------------------------------------------------------------
    @magic_arguments()
    @sampling_arguments
    @argument("--n", type=int, default=1, metavar="N", help="samples per prompt")
    @argument("--beams", type=int, default=None, metavar="B",
              help="beam search with B beams: shows the B best hypotheses, best first")
    @argument("--raw", action="store_true", help="send the text as is, without the chat template")
    @argument("--speculative", default=None, metavar="ngram|MODEL", help="speculative decoding")
    @argument("--background", action="store_true",
              help="return at once; the result appears in this cell's output when done")
    @cell_magic
    def generate(self, line: str, cell: str) -> None:
        """Generate from the cell's text (several prompts, separated by `---` lines, run concurrently)."""
        args = parse_line(self.generate, line)
        engine = self.session.require_engine()
        params = generate_params(args, self.shell.user_ns)
        if args.speculative is not None:
            try:
                params.speculative = engine.add_drafter(args.speculative)
            except ValueError as err:   # an unknown draft model, another vocabulary
                raise UsageError(f"--speculative: {err}") from None
        texts = split_prompts(interpolate(cell, self.shell.user_ns))
        has_template = engine.has_chat_template
        if args.system is not None and (args.raw or not has_template):
            raise UsageError("--system needs the chat template: drop --raw, or put the instruction "
                             "in the prompt" if args.raw else
                             "--system needs a chat template and this model's tokenizer has none")
        prompts: list = []
        for text in texts:
            if args.raw or not has_template:
                prompts.append(text)
            else:
                head = [{"role": "system", "content": args.system}] if args.system is not None else []
                prompts.append(engine.apply_chat_template(head + [{"role": "user", "content": text}]))
        labels = [f"[{i + 1}] {_short(t)}" for i, t in enumerate(texts)]
        run = CellRun(engine, labels, args.tenant, args.priority)
        if args.background:
            self._cells.start_background(run, prompts, params, args.out, args.no_stream, args.format)
            return
        outputs = self._cells.run(run, prompts, params, "generate", args.no_stream, args.format)
        show_logprobs(args, outputs)
        if args.out:
            self.shell.user_ns[args.out] = kept_output(outputs, params)

    # -- %%chat -----------------------------------------------------------------------------------
    @magic_arguments()
    @argument("session", nargs="?", default="default", metavar="SESSION",
              help="the conversation to continue (default 'default'); each has its own history")
    @argument("--reset", action="store_true", help="forget the session's history first")
    @sampling_arguments
    @line_cell_magic
    def chat(self, line: str, cell: str | None = None) -> None:
        """One turn of a multi-turn chat; the earlier turns are a cached prefix of this turn's prompt.

        As a line magic, `%chat SESSION --reset` only forgets the session."""
        args = parse_line(self.chat, line)
        name = args.session
        if not SESSION_NAME.match(name):
            raise UsageError(f"session name {name!r}: use letters, digits, '_', '-' or '.'")
        message = (cell or "").strip()
        if args.reset:
            if name not in self.session.chats and not message:
                known = ", ".join(sorted(self.session.chats)) or "none yet"
                raise UsageError(f"no chat session {name!r} to reset (sessions: {known})")
            self.session.chats.pop(name, None)
            if not message:
                print(f"chat session {name!r} reset")
                return
        if not message:
            raise UsageError("no message: write it in the cell below `%%chat` (`%chat NAME --reset` "
                             "alone only resets)")
        engine = self.session.require_engine()
        if not engine.has_chat_template:
            raise UsageError("this model's tokenizer has no chat template: use %%generate --raw")
        params = sampling_params(args, self.shell.user_ns)
        chat = self.session.chat(name)
        if args.tenant is not None:
            if chat.num_turns and args.tenant != chat.tenant:
                raise UsageError(f"chat session {name!r} belongs to tenant {chat.tenant!r}: continue it "
                                 f"without --tenant, or start another session for {args.tenant!r}")
            chat.tenant = args.tenant
        if args.system is not None:
            chat.system = args.system
        message = interpolate(message, self.shell.user_ns)
        prompt = chat.prompt_ids(engine, message)
        run = CellRun(engine, [f"{name} #{chat.num_turns + 1}"], chat.tenant, args.priority)
        outputs = self._cells.run(run, [prompt], params, f"chat {name}", args.no_stream, args.format)
        show_logprobs(args, outputs)
        if (line := recomputed_line(engine, outputs[0])) is not None:
            print(line)
        chat.record(message, outputs[0])
        if args.out:
            self.shell.user_ns[args.out] = kept_output(outputs, params)


def recomputed_line(engine, output) -> str | None:
    """The chat footer's extra line: a turn that recomputed more than one block some cache held
    (evicted, another tenant's or model's, past a miss); None otherwise or where nobody can tell."""
    try:
        report = engine.why(output.request_id)
    except ValueError:   # a server cannot tell; an aborted turn never admitted
        return None
    return report.line() if report.num_reusable > 1 else None


def _short(text: str, width: int = 40) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
