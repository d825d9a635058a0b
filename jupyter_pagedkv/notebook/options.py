"""The magics' options and cell parsing: `%pagedkv load` flags (one per EngineConfig field), the
sampling flags `%%generate` and `%%chat` share, `{name}` interpolation, `---` separated prompts,
shell-quoted option lines. Every user mistake is one UsageError line."""
from __future__ import annotations

import re
import shlex
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ..config import load_arguments as config_arguments

DEFAULT_MAX_TOKENS = 128
_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)*)\}")
_SEPARATOR = re.compile(r"^[ \t]*---[ \t]*$", re.MULTILINE)
SESSION_NAME = re.compile(r"^[\w.-]+$")

def interpolate(text: str, namespace: dict[str, Any]) -> str:
    """Replace {name} and {name.attr} from the user namespace; other braces stay as written."""
    def sub(m: re.Match) -> str:
        if m.group(0) in ("{{", "}}"):
            return m.group(0)[0]
        name = m.group(1)
        if name not in namespace:
            raise UsageError(f"the prompt uses {{{name}}} but {name!r} is not defined: define it, "
                             f"or write {{{{{name}}}}} for literal braces")
        value = namespace[name]
        for attr in filter(None, m.group(2).split(".")):
            if not hasattr(value, attr):
                raise UsageError(f"the prompt uses {m.group(0)} but {name}{m.group(2)} does not exist")
            value = getattr(value, attr)
        return str(value)
    return _FIELD.sub(sub, text)


def split_prompts(cell: str) -> list[str]:
    """Prompts separated by lines holding only `---`; each is stripped and must not be empty."""
    parts = [p.strip() for p in _SEPARATOR.split(cell)]
    if not any(parts):
        raise UsageError("the cell is empty: write the prompt below the magic line")
    if not all(parts):
        raise UsageError("an empty prompt next to a `---` line: remove the extra separator")
    return parts


def connect_parser():
    """`%pagedkv connect`'s parser (also read by the docs test); a mistake is one UsageError line."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            raise UsageError(f"{message} (e.g. %pagedkv connect http://127.0.0.1:8000 --model NAME --api-key-env VLLM_API_KEY)")

    p = Parser(prog="%pagedkv connect", add_help=False)
    p.add_argument("url")
    p.add_argument("--api-key-env", default=None, metavar="NAME")
    p.add_argument("--api-key", default=None)   # works, but is saved in the notebook: warns
    p.add_argument("--model", default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT")
    p.add_argument("--kv-events-topic", default="")
    return p


def parse_connect(rest: str):
    """`%pagedkv connect` options; a mistake is one UsageError line."""
    try:
        argv = shlex.split(rest)
    except ValueError as err:
        raise UsageError(f"cannot read the options: {err} (check the quotes)") from None
    return connect_parser().parse_args(argv)


def parse_line(magic: Callable, line: str):
    """Parse a magic's options with shell quoting (`--system "Be brief."` loses its quotes, unlike
    IPython's own splitter); every mistake is one UsageError line."""
    try:
        argv = shlex.split(line)
    except ValueError as err:
        raise UsageError(f"cannot read the options: {err} (check the quotes)") from None
    return magic.parser.parse_args(argv)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(s: str) -> str:
    """Let `--stop "\\n"` mean a newline, as a user types it (\\n, \\t, \\r and \\\\; any other
    backslash stays as written, so no text can fail to decode)."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), s)


def load_arguments(f: Callable) -> Callable:
    """`%pagedkv load`'s options: one per EngineConfig field, with its flag, default and help."""
    for args, kwargs in reversed(config_arguments()):
        f = argument(*args, **kwargs)(f)
    return f


# The logits-processor and structured-output options beside their "off" values: beam search
# takes none of them.
PROCESSOR_DEFAULTS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                      "frequency_penalty": 0.0, "min_tokens": 0, "bad_word": None, "logit_bias": None,
                      "allowed_token_ids": None, "json_schema": None, "regex": None, "choice": None}


def sampling_arguments(f: Callable) -> Callable:
    """The options %%generate and %%chat share."""
    for arg in reversed([
        argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                 help=f"most tokens to generate per prompt (default {DEFAULT_MAX_TOKENS})"),
        argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)"),
        argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, (0, 1]"),
        argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)"),
        argument("--min-p", type=float, default=0.0,
                 help="drop tokens under P x the most likely one's probability (0: off)"),
        argument("--repetition-penalty", type=float, default=1.0,
                 help="> 1 discourages every token of the prompt and the answer so far (1: off)"),
        argument("--presence-penalty", type=float, default=0.0,
                 help="[-2, 2], subtracted once from each token the answer already holds (0: off)"),
        argument("--frequency-penalty", type=float, default=0.0,
                 help="[-2, 2], subtracted per occurrence in the answer so far (0: off)"),
        argument("--min-tokens", type=int, default=0, help="no EOS or stop token before N new tokens"),
        argument("--bad-word", action="append", default=None, metavar="W",
                 help="never generate the word W (repeatable)"),
        argument("--logit-bias", default=None, metavar="ID=B,...",
                 help="add B to token ID's logit, e.g. 7=-5,42=2.5 (-100 bans, 100 forces)"),
        argument("--allowed-token-ids", default=None, metavar="ID,...",
                 help="generate only these token ids, e.g. 3,17,42"),
        argument("--json-schema", default=None, metavar="VAR",
                 help="the answer follows the JSON schema in variable VAR (a dict, or a pydantic model "
                      "class: --out then holds a validated instance)"),
        argument("--regex", default=None, metavar="RE", help="the answer matches the regular expression RE"),
        argument("--choice", default=None, metavar="A,B,...", help="the answer is exactly one of A, B, ..."),
        argument("--include-stop-str", action="store_true", help="keep the --stop text at the end of the answer"),
        argument("--keep-special-tokens", action="store_true",
                 help="show special tokens (such as EOS) in the answer's text"),
        argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling"),
        argument("--logprobs", type=int, default=None, metavar="K",
                 help="show each answer token shaded by its probability, the K most likely tokens (it "
                      "among them) on hover (the raw model distribution; --out keeps them)"),
        argument("--prompt-logprobs", type=int, default=None, metavar="K",
                 help="the same for the prompt's tokens"),
        argument("--stop", action="append", default=None, metavar="S",
                 help="stop when the text contains S (repeatable; \\n and \\t are understood)"),
        argument("--system", default=None, metavar="TEXT", help="system message for the chat template"),
        argument("--tenant", default=None, metavar="NAME",
                 help="who sends the cell's requests (with --prefix-cache-scope tenant at load, a tenant "
                      "hits only its own cached prefixes)"),
        argument("--priority", type=int, default=0, metavar="N",
                 help="the cell's requests' priority: lower runs first (queue order under every "
                      "policy; preempts higher under --scheduling-policy priority at load)"),
        argument("--out", default=None, metavar="VAR",
                 help="store the RequestOutput (a list for several prompts) in variable VAR"),
        argument("--no-stream", action="store_true", help="show the text only when it is complete"),
        argument("--format", default=None, choices=("markdown", "text"),
                 help="how answers are shown: markdown (the default in a notebook: lists, tables, "
                      "highlighted code) or text (the default in a terminal, where Markdown cannot render)"),
    ]):
        f = arg(f)
    return f


def _flagged(err: ValueError) -> UsageError:
    """A SamplingParams error in the magics' words: `--max-tokens` where the field says max_tokens."""
    text = str(err)
    field, _, rest = text.partition(" must be ")
    if rest and field.isidentifier():
        flag = "--beams" if field == "beam_width" else "--" + field.replace("_", "-")
        text = f"{flag} must be {rest}"
    else:   # a rule between two fields, e.g. "min_tokens (9) must not exceed max_tokens (4)"
        text = re.sub(r"\b(min_tokens|max_tokens)\b", lambda m: "--" + m.group(1).replace("_", "-"), text)
    return UsageError(text)


def _token_ids(flag: str, text: str) -> list[str]:
    """The comma-separated items of `--flag a,b`; an empty item is one UsageError line."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise UsageError(f"{flag} {text!r}: an empty item between commas (write e.g. {flag} 3,17,42)")
    return items


def logit_bias(text: str | None) -> dict[int, float] | None:
    """`--logit-bias 7=-5,42=2.5` as {7: -5.0, 42: 2.5}."""
    if text is None:
        return None
    bias = {}
    for item in _token_ids("--logit-bias", text):
        tok, _, value = item.partition("=")
        try:
            bias[int(tok)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias item {item!r}: write TOKEN_ID=BIAS, e.g. --logit-bias 7=-5,42=2.5") from None
    return bias


def allowed_token_ids(text: str | None) -> list[int] | None:
    """`--allowed-token-ids 3,17,42` as [3, 17, 42]."""
    if text is None:
        return None
    try:
        return [int(t) for t in _token_ids("--allowed-token-ids", text)]
    except ValueError:
        raise UsageError(f"--allowed-token-ids {text!r}: write token ids separated by commas, e.g. 3,17,42") from None


def structured_outputs(args, namespace: dict[str, Any]):
    """StructuredOutputsParams from --json-schema VAR (looked up in the notebook), --regex or
    --choice; None without any. Two at once, or an unusable VAR, is one UsageError line."""
    from ..core.structured_outputs import StructuredOutputsParams, is_model_class
    given = [flag for flag, v in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                  ("--choice", args.choice)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} cannot be combined: the answer follows one structure")
    try:
        if args.regex is not None:
            return StructuredOutputsParams(regex=unescape(args.regex))
        if args.choice is not None:
            return StructuredOutputsParams(choice=[c.strip() for c in args.choice.split(",")])
        name = args.json_schema
        if name not in namespace:
            raise UsageError(f"--json-schema {name}: {name!r} is not defined: define a JSON-schema dict or a "
                             f"pydantic model class with that name first")
        schema = namespace[name]
        if not (isinstance(schema, (dict, str)) or is_model_class(schema)):
            raise UsageError(f"--json-schema {name}: {name} is a {type(schema).__name__}; it must be a "
                             f"JSON-schema dict or a pydantic model class")
        return StructuredOutputsParams(json=schema)
    except ValueError as err:
        raise UsageError(str(err).replace("structured_outputs.choice", "--choice")
                         .replace("structured_outputs.regex", "--regex")) from None


def sampling_params(args, namespace: dict[str, Any] | None = None):
    """The SamplingParams of a %%generate / %%chat line (its --n included, when it has one);
    `namespace` is where --json-schema VAR is looked up (the notebook's variables)."""
    from ..core.sampling_params import SamplingParams
    if args.out is not None and not args.out.isidentifier():
        raise UsageError(f"--out {args.out!r} is not a valid variable name")
    spec = structured_outputs(args, namespace or {})
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              stop=[unescape(s) for s in args.stop or []], n=getattr(args, "n", 1),
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              min_tokens=args.min_tokens, bad_words=args.bad_word,
                              include_stop_str_in_output=args.include_stop_str,
                              skip_special_tokens=not args.keep_special_tokens,
                              logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                              logit_bias=logit_bias(args.logit_bias),
                              allowed_token_ids=allowed_token_ids(args.allowed_token_ids),
                              structured_outputs=spec)
    except ValueError as err:
        raise _flagged(err) from None


def generate_params(args, namespace: dict[str, Any] | None = None):
    """What a %%generate line asks for: SamplingParams, or BeamSearchParams with --beams. Limits
    that need the engine (n and beams against max_num_seqs, the context, the pool) are checked
    when the cell's requests are added."""
    params = sampling_params(args, namespace)
    return beam_params(args) if args.beams is not None else params


def beam_params(args):
    """--beams B: deterministic beam search; sampling and stop options have no meaning there."""
    from ..core.sampling_params import BeamSearchParams
    if args.beams < 1:
        raise UsageError(f"--beams must be >= 1, got {args.beams}")
    clash = [name for name, used in (("--n", args.n != 1), ("--temperature", args.temperature != 0.0),
                                     ("--top-p", args.top_p != 1.0), ("--top-k", args.top_k != 0),
                                     ("--seed", args.seed is not None), ("--stop", bool(args.stop)),
                                     *((f"--{name.replace('_', '-')}", getattr(args, name) != off)
                                       for name, off in PROCESSOR_DEFAULTS.items()),
                                     ("--logprobs", args.logprobs is not None),
                                     ("--prompt-logprobs", args.prompt_logprobs is not None),
                                     ("--speculative", args.speculative is not None))
             if used]
    if clash:
        raise UsageError(f"--beams is deterministic and cannot be combined with {', '.join(clash)}: "
                         f"drop {'it' if len(clash) == 1 else 'them'}")
    try:
        return BeamSearchParams(beam_width=args.beams, max_tokens=args.max_tokens)
    except ValueError as err:
        raise _flagged(err) from None


def kept_output(outputs: list, params) -> Any:
    """What `--out VAR` holds: the RequestOutput (a list for several prompts), or with
    `--json-schema` naming a pydantic class, the validated instance(s) of the answers (a list for
    several prompts or samples). An answer that does not validate is one UsageError line."""
    spec = getattr(params, "structured_outputs", None)
    from ..core.structured_outputs import is_model_class
    if spec is None or not is_model_class(spec.json):
        return outputs[0] if len(outputs) == 1 else outputs
    instances = []
    for out in outputs:
        for c in out.outputs:
            try:
                instances.append(spec.json.model_validate_json(c.text))
            except ValueError as err:
                hint = " (raise --max-tokens)" if c.finish_reason == "length" else ""
                raise UsageError(f"the answer is not a valid {spec.json.__name__}: finish reason "
                                 f"{c.finish_reason!r}{hint}; {str(err).splitlines()[0]}") from None
    return instances[0] if len(instances) == 1 else instances
