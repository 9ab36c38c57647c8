"""KV Scope entry point.

    python main.py                      the window (falls back to the terminal view with no display)
    python main.py calc ...             what a context costs, for any model config, nothing loaded
    python main.py run ...              generate in the terminal with a live memory table
    python main.py watch URL...         inference servers' KV cache from their /metrics, in bytes
    python main.py replay FILE          play a recording back in the window
    python main.py export FILE --csv    recording -> CSV
    python main.py --screenshot out.png [--tokens N] [run options]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from kvscope.core import __version__ as APP_VERSION
from kvscope.core.base.errors import BAD_INPUT, KVScopeError, is_user_error
from kvscope.core.base.regular_file import read_regular_file
from kvscope.core.base.safe_text import safe_text
from kvscope.core.base.streams import guard_stdout, hold_closed_descriptors, require_stdout
from kvscope.core.records.outputs import OutputError, check_output_path, display_path


class CliError(KVScopeError):
    """A bad command line or input: printed as one line on stderr, exit status 2."""

    category = BAD_INPUT


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded",
                   help="preset name (e.g. llama-3-8b), local config.json / model folder, a .gguf file, or hub id "
                        "(default: embedded)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--dtype", default=None, help="weights dtype: fp32, fp16, bf16 (default: the model's)")
    from kvscope.core.model.attention import attention_spellings  # (no torch: a ModelSpec rewrite)

    p.add_argument("--attention", default=None,
                   help=f"{attention_spellings(sep=' | ', last=' | ')} (default: as the model is built)")
    p.add_argument("--cache", default="dynamic",
                   help="dynamic | static | quantized[:4|:2|:hqq:4|:fp8] | offloaded | sink:S+W | h2o:B+W")
    p.add_argument("--attn-impl", default="sdpa", help="eager | sdpa | flash (default sdpa)")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    _add_model_options(p)
    p.add_argument("--device", default="auto", help="auto | cuda | cuda:N | mps | cpu (default auto)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to generate (run: default 128; the window: its New tokens, remembered, 3000 at first)")
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--max-context", default=None, help="context a static cache preallocates, e.g. 4096 or 4k")
    p.add_argument("--record", default=None, metavar="FILE.jsonl", help="record every sample to a JSONL file")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --record, --snapshot or --screenshot file (never a device or folder)")
    p.add_argument("--switch", action="append", default=[], metavar="T:KEY=VALUE",
                   help="change a setting at token T, e.g. 32:attention=mqa, 64:attn-impl=eager (repeatable)")
    p.add_argument("--memory-budget", default=None, help="stop when the model's memory would exceed SIZE (e.g. 64MiB)")
    p.add_argument("--snapshot", default=None, metavar="FILE", help="CUDA: save an allocator snapshot of the run")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a hub model's own Python code (off by default)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow pickle (.bin) weights when no safetensors exist (off by default: pickle can run code)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--quality-probe", action="store_true",
                   help="also run every token through the model as loaded (teacher-forced, whatever was switched) "
                        "and report top-1 agreement and KL of the next-token distributions (costs a second forward "
                        "pass and a second cache; off by default)")
    p.add_argument("--runtime", default=None, choices=_runtime_names(),
                   help=f"where the model runs: {_runtime_labels()} (default: the runtime that claims the --model's "
                        "file, e.g. a .gguf, else the first)")
    _add_runtime_flags(p, "run")


def _add_runtime_flags(p: argparse.ArgumentParser, command: str) -> None:
    """Each runtime's own flags, from its ``add_flags`` hook (``run``'s or ``calc``'s: ``command``); their ranges
    join ``NUMBER_RANGES``, and the parser remembers which runtime each is of (``_refuse_other_runtimes_flags``)."""
    from kvscope.core import runtimes

    owners: dict[str, tuple[str, str, object]] = {}
    for name in runtimes.names():
        add = runtimes.get(name).hook("add_flags")
        if add is None:
            continue
        before = {a.dest for a in p._actions}
        NUMBER_RANGES.update(add(p, command) or {})
        owners.update({a.dest: (name, max(a.option_strings, key=len), a.default)
                       for a in p._actions if a.dest not in before and a.option_strings})
    p.set_defaults(runtime_flags=owners)


def _refuse_other_runtimes_flags(args: argparse.Namespace, runtime: str) -> None:
    """A flag of another runtime, given to a ``runtime`` run, is refused in one line (it was silently ignored)."""
    for dest, (owner, option, default) in (getattr(args, "runtime_flags", None) or {}).items():
        if owner != runtime and getattr(args, dest, default) != default:
            raise CliError(f"{option} is --runtime {owner}'s flag, not --runtime {runtime}'s"
                           + (" (a static cache's context is --max-context)" if dest == "context" else ""))


#: ``calc --runtime vllm``: not a runtime KV Scope drives, but the transformers prediction sized by vLLM's rules.
CALC_VLLM = "vllm"


def _runtime_names() -> tuple[str, ...]:
    from kvscope.core import runtimes

    return runtimes.names()


def _runtime_labels() -> str:
    """``--runtime``'s choices with their labels, for its help."""
    from kvscope.core import runtimes

    return "; ".join(f"{name}: {runtimes.get(name).label}" for name in runtimes.names())


def _add_metrics_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free port)")
    p.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="bind the metrics server to HOST instead of 127.0.0.1 (e.g. 0.0.0.0: every interface)")


def _start_metrics(args: argparse.Namespace):
    """(collector, exporter) serving on --metrics-host/--metrics-port, said on stderr; (None, None) without a port."""
    if args.metrics_port is None:
        if args.metrics_host is not None:
            raise CliError("--metrics-host needs --metrics-port")
        return None, None
    from kvscope.core.live.metrics import LOOPBACK, MetricsError, MetricsExporter, RunCollector, is_loopback

    collector = RunCollector(model=args.model, device=args.device)
    try:
        exporter = MetricsExporter(collector, args.metrics_host or LOOPBACK, args.metrics_port).start()
    except MetricsError as exc:
        raise CliError(str(exc)) from None
    where = "" if is_loopback(exporter.host) else " (reachable from other machines: you asked for this host)"
    print(f"kvscope: Prometheus metrics at {exporter.url}{where}", file=sys.stderr, flush=True)
    return collector, exporter


def _add_view_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, metavar="WxH",
                   help="window size in logical pixels, e.g. 1280x720 (a screenshot's default: 1600x1000)")
    p.add_argument("--scale", type=float, default=None, metavar="F",
                   help="display scaling, e.g. 2 for a 4K screen at 200%% (Qt's QT_SCALE_FACTOR)")
    p.add_argument("--presenter", action="store_true", help="presenter mode: large type, thick lines (F11)")


def _view(args: argparse.Namespace) -> dict:
    """--size, --scale, --presenter checked, and the scale set before Qt starts (it reads it once)."""
    size = None
    if args.size:
        w, sep, h = str(args.size).lower().partition("x")
        if not sep or not (w.isascii() and w.isdigit() and h.isascii() and h.isdigit()):
            raise CliError(f"--size {args.size!r}: write WxH in logical pixels, e.g. 1280x720")
        size = (int(w), int(h))
        if not (320 <= size[0] <= 16384 and 240 <= size[1] <= 16384):
            raise CliError(f"--size {args.size}: each side must be 320-16384 x 240-16384 pixels")
    if args.scale is not None:
        if not (0.5 <= args.scale <= 8):  # also refuses NaN
            raise CliError(f"--scale {args.scale}: use a factor from 0.5 to 8")
        os.environ["QT_SCALE_FACTOR"] = f"{args.scale:g}"
    return {"size": size, "presenter": bool(args.presenter)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description="KV Scope: see and predict the KV cache.")
    parser.add_argument("--version", action="version", version=f"KV Scope {APP_VERSION}")
    parser.add_argument("--screenshot", default=None, metavar="PNG", help="open the window, run, save a PNG, exit")
    _add_view_options(parser)
    parser.add_argument("--self-test", action="store_true", help="load the embedded model, generate offscreen, exit 0")
    _add_run_options(parser)
    _add_metrics_options(parser)
    sub = parser.add_subparsers(dest="command")

    calc = sub.add_parser("calc", help="predict memory for a model config and contexts (nothing is loaded)")
    _add_model_options(calc)
    calc.add_argument("--context", default="4096,32768,131072", help="comma-separated contexts: 4096,32768 or 4k,32K,128k")
    calc.add_argument("--kv-dtype", default=None, help="KV cache dtype: fp16, bf16, fp8, int8, int4 (default: weights dtype)")
    calc.add_argument("--max-context", default=None, help="what a static cache preallocates (default: each context)")
    calc.add_argument("--gpu-memory", default=None, help="answer the largest context that fits, e.g. 24GiB (per GPU)")
    calc.add_argument("--device", default=None,
                      help="where --json's prefill and decode peaks run: cuda, mps (a GPU, the default) or cpu")
    calc.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                      help="--device cpu: torch's threads (default: the app's engine's)")
    calc.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                      help="split each layer over N GPUs, vLLM's way (KV heads split, replicated past their count)")
    calc.add_argument("--pipeline-parallel", type=int, default=1, metavar="M", help="split the layers over M GPU stages")
    calc.add_argument("--runtime", default="transformers", choices=(*_runtime_names(), CALC_VLLM),
                      help="vllm: also the KV blocks, tokens and concurrency vLLM 0.33.0 would have (needs --gpu-memory); "
                           "a runtime with a calculator of its own: what it allocates for each --context")
    calc.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                      help="--runtime vllm: vLLM's gpu_memory_utilization (default 0.92, vLLM 0.33.0's)")
    calc.add_argument("--block-size", type=int, default=None, help="--runtime vllm: tokens per KV block (default 16)")
    calc.add_argument("--max-model-len", default=None, help="--runtime vllm: tokens per request (default: the model's maximum)")
    calc.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="--runtime vllm: tokens of the profile run (default: vLLM's for the GPU size)")
    calc.add_argument("--non-torch-memory", default=None, metavar="SIZE",
                      help="--runtime vllm: memory outside torch per GPU, CUDA context and NCCL (default 512MiB, an estimate)")
    calc.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                      help="--runtime vllm: the KV memory per GPU, as vLLM's kv_cache_memory_bytes (or its log's "
                           "'Available KV cache memory'): no estimate enters")
    calc.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                      help="--runtime vllm: window layers take blocks for every token, as full ones (vLLM's flag)")
    calc.add_argument("--cudagraph-memory", default=None, metavar="SIZE",
                      help="--runtime vllm: CUDA graphs per GPU (default 512MiB, an estimate; 0 for --enforce-eager)")
    _add_runtime_flags(calc, "calc")
    calc.add_argument("--json", action="store_true", help="print one JSON object")

    run = sub.add_parser("run", help="generate in the terminal with a live table of observed vs predicted memory")
    _add_run_options(run)
    _add_metrics_options(run)
    run.add_argument("--metrics-linger", type=float, default=0.0, metavar="S",
                     help="keep serving the metrics S seconds after the run ends, for a last scrape (default 0)")

    watch = sub.add_parser("watch", help="scrape inference servers' /metrics (vLLM, SGLang, llama-server, TGI, KV Scope) "
                                         "and show their KV cache in bytes")
    watch.add_argument("urls", nargs="+", metavar="URL", help="a server, e.g. http://127.0.0.1:8000 (/metrics is added)")
    watch.add_argument("--model", default=None,
                       help="the served model's config (preset, config.json or folder) for bytes; default: the server's "
                            "/v1/models matched to a preset")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (default 2)")
    watch.add_argument("--count", type=int, default=None, help="scrapes per server, then exit (default: until Ctrl+C)")
    watch.add_argument("--timeout", type=float, default=2.0, help="seconds a server has to answer (default 2)")
    watch.add_argument("--warn-usage", type=float, default=0.9, help="warn from this KV usage fraction (default 0.9)")
    watch.add_argument("--json", action="store_true", help="one JSON object per reading")

    replay = sub.add_parser("replay", help="play a recording back in the window (no model, no GPU)")
    replay.add_argument("file")
    replay.add_argument("--speed", type=float, default=1.0, help="playback speed factor (default 1)")
    replay.add_argument("--screenshot", default=None, metavar="PNG", help="save a PNG of the window at the end (- for stdout)")
    replay.add_argument("--force", action="store_true", help="replace an existing --screenshot file")
    _add_view_options(replay)

    export = sub.add_parser("export", help="export a recording")
    export.add_argument("file")
    export.add_argument("--csv", default=None, metavar="OUT.csv", help="CSV file to write (- for standard output)")
    export.add_argument("--force", action="store_true", help="replace an existing --csv file")
    _own_whole_numbers(parser)
    return parser


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its subcommands' parsers."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(p for sub in subs for p in sub.choices.values())]


_MAX_COUNT = 2**31 - 1  # kvscope.core.model.spec.MAX_COUNT (not imported: the parser is built before any of core)

#: The range of every number option, in one place: dest -> (lowest, highest, what it counts; what its lowest
#: means where that is a special value). ``_own_whole_numbers`` checks a value against it as argparse parses it, so
#: that ``--fit-target -5`` or ``--prompt-tokens -1`` is refused in the flag's words instead of predicted from.
#: Options left out are checked by their own rule, in their own words: --batch (``_check_amounts`` and the
#: settings' bound), --seed (``check_seed``), a runtime's flags its own rule leaves out, --scale (``_view``), watch's
#: --interval, --timeout and --warn-usage. Each runtime's flags add their own ranges (``_add_runtime_flags``).
NUMBER_RANGES: dict[str, tuple[float, float, str]] = {
    "tokens": (1, _MAX_COUNT, "tokens to generate"),
    "cpu_threads": (1, 4096, "CPU threads"),
    "tensor_parallel": (1, 4096, "GPUs each layer is split over"),
    "pipeline_parallel": (1, 4096, "GPU stages"),
    "block_size": (1, 1 << 20, "tokens per KV block"),
    "max_num_batched_tokens": (1, _MAX_COUNT, "tokens of vLLM's profile run"),
    "gpu_memory_utilization": (0.01, 1, "the share of each GPU's memory vLLM may use"),
    "metrics_port": (0, 65535, "a TCP port; 0: any free port"),
    "metrics_linger": (0, 3600, "seconds"),
    "count": (1, _MAX_COUNT, "scrapes per server"),
}


def _out_of_range(option: str, dest: str, value: float, example: str) -> CliError | None:
    """The refusal of ``value`` for ``option`` by ``NUMBER_RANGES`` (None when in range, or not listed)."""
    if dest not in NUMBER_RANGES:
        return None
    low, high, what = NUMBER_RANGES[dest]
    if low <= value <= high:  # NaN is never in range
        return None
    shown = value if isinstance(value, int) and len(str(value)) <= 24 else (
        f"a {len(str(value).lstrip('-'))}-digit number" if isinstance(value, int) else f"{value:g}")
    return CliError(f"{option} must be {_number_text(low)} to {_number_text(high)} ({what}), e.g. {option} {example} "
                    f"(got {shown})")


def _number_text(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def _whole_number(option: str, example: int, dest: str = ""):
    """argparse's ``type`` for an int option, refusing in KV Scope's words (argparse said "invalid int value"), and
    values outside the option's ``NUMBER_RANGES``."""
    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        if digits.isascii() and digits.isdigit() and len(digits) > 4000:  # int() refuses past 4,300 digits
            raise CliError(f"{option}: a {len(digits):,}-digit number is implausible")
        try:
            value = int(text)
        except ValueError:
            raise CliError(f"{option} {safe_text(repr(text), limit=60)} is not a whole number; write it in digits, "
                           f"e.g. {option} {example}") from None
        problem = _out_of_range(option, dest, value, str(example))
        if problem is not None:
            raise problem
        return value
    parse.__name__ = "whole number"
    return parse


def _real_number(option: str, example: float, dest: str = ""):
    """argparse's ``type`` for a float option: a finite number (argparse said "invalid float value"; NaN passed)
    within the option's ``NUMBER_RANGES``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or value != value or value in (float("inf"), float("-inf")):
            raise CliError(f"{option} {safe_text(repr(text), limit=60)} is not a number; write it in digits, "
                           f"e.g. {option} {example:g}")
        problem = _out_of_range(option, dest, value, f"{example:g}")
        if problem is not None:
            raise problem
        return value
    parse.__name__ = "number"
    return parse


def _own_whole_numbers(parser: argparse.ArgumentParser) -> None:
    """Every ``type=int`` and ``type=float`` option of every command parses with ``_whole_number`` /
    ``_real_number``: a refusal names the option, and ``NUMBER_RANGES`` bounds its value."""
    for p in _parsers(parser):
        for action in p._actions:
            if action.type not in (int, float) or not action.option_strings:
                continue
            option = max(action.option_strings, key=len)
            if action.type is int:
                example = action.default if isinstance(action.default, int) and action.default > 0 else 4
                action.type = _whole_number(option, example, action.dest)
            else:
                example = action.default if isinstance(action.default, float) and action.default > 0 else 1.0
                action.type = _real_number(option, example, action.dest)


#: A value that argparse takes for an option because it starts with "-": a negative number, written any way
#: (``-4k``, ``-8GiB``, ``-5:attention=mqa``, ``-.5``, ``-inf``). No option of KV Scope starts with "-" and a digit.
_DASH_VALUE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)


def glue_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--context -4k`` as ``--context=-4k``: argparse answered "expected one argument" (it took -4k for an
    option) where the value was given and KV Scope's own check has the words for it. Only after an option that
    takes one value, only for a value that looks like a negative number, never after ``--``."""
    takes_value = {s for p in _parsers(parser) for a in p._actions if a.option_strings and a.nargs is None
                   for s in a.option_strings}
    glued, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            glued.extend(argv[i:])
            break
        if arg in takes_value and i + 1 < len(argv) and _DASH_VALUE.match(argv[i + 1]):
            glued.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        glued.append(arg)
        i += 1
    return glued


def _settings_from(args: argparse.Namespace):
    from kvscope.core.model.attention import parse_attention
    from kvscope.core.model.caches import parse_cache
    from kvscope.core.model.settings import RunSettings, parse_attn_impl
    from kvscope.core.model.spec import parse_tokens

    return RunSettings(
        batch=args.batch,
        weight_dtype=args.dtype,
        kv_dtype=getattr(args, "kv_dtype", None),
        attention=parse_attention(args.attention) if args.attention else None,
        cache=parse_cache(args.cache),
        attn_impl=parse_attn_impl(args.attn_impl),
        max_context=parse_tokens(args.max_context) if args.max_context else None,
    )


#: Options whose value cannot be empty, with what to give instead. Left empty, `--memory-budget ''` meant no
#: budget, `--max-context ''` no limit, `--prompt-file ''` the default prompt and `--model ''` the embedded
#: model (while calc refused it): each is refused the same way by calc and run (_refuse_empty_values).
_NOT_EMPTY = {
    "model": None,  # the message of kvscope.core.model.spec.check_model_name, as the window's calculator says it
    "dtype": "fp32, fp16 or bf16", "kv_dtype": "fp16, bf16, fp8, int8 or int4", "attention": None,  # the modes' own spellings (attention_spellings)
    "cache": "dynamic, static, quantized, offloaded, sink:S+W or h2o:B+W", "attn_impl": "eager, sdpa or flash",
    "device": "auto, cpu, cuda, cuda:N or mps", "context": "token counts such as 4k,32k", "max_context": "a token count such as 4k",
    "gpu_memory": "a size such as 24GiB", "memory_budget": "a size such as 64MiB", "prompt_file": "a text file",
    "record": "a .jsonl file", "snapshot": "a file",
}


def _refuse_empty_values(args: argparse.Namespace) -> None:
    """One place for calc and run: an option given an empty value is refused, not read as "not given"."""
    from kvscope.core.model.spec import check_model_name

    from kvscope.core.model.attention import attention_spellings

    for dest, instead in _NOT_EMPTY.items():
        value = getattr(args, dest, None)
        if isinstance(value, str) and not value.strip():
            if dest == "attention":
                instead = attention_spellings()
            elif instead is None:
                check_model_name(value)  # SpecError: "empty model name; give a preset name, ..."
            raise CliError(f"--{dest.replace('_', '-')} is empty; give {instead}, or leave the option out")
    for switch in getattr(args, "switch", None) or ():
        if not switch.strip():
            raise CliError("--switch is empty; write T:KEY=VALUE, e.g. 32:attention=mqa")


#: Options that are an amount: (kind, may it be 0). Each value is checked with its option's name before anything
#: else reads it: `--context -4k` said "token count must be a positive whole number, got '-4k'" (naming no option),
#: and a --runtime vllm option's bad value was ignored under any other runtime.
_AMOUNTS = {
    "context": ("tokens", False), "max_context": ("tokens", False), "max_model_len": ("tokens", False),
    "gpu_memory": ("size", False), "memory_budget": ("size", False), "kv_cache_memory": ("size", False),
    "non_torch_memory": ("size", True), "cudagraph_memory": ("size", True),
}
_EXAMPLES = {"tokens": "a positive token count, e.g. 4096 or 4k", "size": "a positive size, e.g. 24GiB or 512MiB"}


def _amount(option: str, text: str, kind: str, zero: bool) -> int:
    """``text`` as ``option``'s amount (tokens or bytes); a refusal names the option. Raises CliError."""
    from kvscope.core.model.spec import SpecError, parse_size, parse_tokens

    shown = safe_text(repr(text.strip()), limit=60)
    if zero and text.strip().lower() in ("0", "0b"):
        return 0
    try:
        return parse_tokens(text) if kind == "tokens" else parse_size(text)
    except SpecError as exc:
        try:
            negative = float(text.strip().lower().rstrip("kmgtib") or "nan") <= 0
        except ValueError:
            negative = text.strip().startswith("-")
        if negative:
            need = (("a size of 0 or more, e.g. 512MiB" if kind == "size" else
                     "a token count of 0 or more (0: the model's trained context), e.g. 4096 or 4k")
                    if zero else _EXAMPLES[kind])
            raise CliError(f"{option} must be {need} (got {shown})") from None
        raise CliError(f"{option}: {exc}") from None


def _check_amounts(args: argparse.Namespace, command: str) -> None:
    """Every amount option given, checked by its own name (calc's --context is a comma-separated list), and
    --batch at least 1 (it said "batch must be positive", naming no option)."""
    if isinstance(getattr(args, "batch", None), int) and args.batch < 1:
        raise CliError(f"--batch must be a positive number of sequences, e.g. --batch 1 (got {args.batch})")
    for dest, (kind, zero) in _AMOUNTS.items():
        value = getattr(args, dest, None)
        if not isinstance(value, str):
            continue
        option = f"--{dest.replace('_', '-')}"
        # run's --context is llama-server's -c, whose 0 means the model's trained context; calc's is a list of contexts
        zero = zero or (dest == "context" and command != "calc")
        for item in (value.split(",") if dest == "context" and command == "calc" else (value,)):
            if item.strip():
                _amount(option, item, kind, zero)


def _size_or_zero(text: str | None) -> int | None:
    """A size that may be 0 (an overhead vLLM does not have, e.g. CUDA graphs under --enforce-eager)."""
    from kvscope.core.model.spec import parse_size

    if text is None:
        return None
    return 0 if str(text).strip().lower() in ("0", "0b") else parse_size(text)


def _vllm_options(args: argparse.Namespace):
    """calc's --runtime vllm options as ``VllmOptions``, checked (its own refusals) whatever the runtime."""
    from kvscope.core.model.spec import parse_size, parse_tokens
    from kvscope.core.prediction.serving import VllmOptions

    given = {"gpu_memory_utilization": args.gpu_memory_utilization, "block_size": args.block_size,
             "max_model_len": parse_tokens(args.max_model_len) if args.max_model_len else None,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "non_torch_bytes": _size_or_zero(args.non_torch_memory), "cudagraph_bytes": _size_or_zero(args.cudagraph_memory),
             "kv_cache_memory": parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
             "hybrid_kv_cache_manager": False if args.disable_hybrid_kv_cache_manager else None}
    return VllmOptions(**{k: v for k, v in given.items() if v is not None})


def _calc_device(args: argparse.Namespace) -> tuple[str, int]:
    """calc's --device (run's spellings; "cpu", or a GPU: the figures without the CPU's sdpa scratch) and
    --cpu-threads, only with --device cpu (its range is NUMBER_RANGES'); default the app's thread count."""
    from kvscope.core.runtimes.transformers.calc import app_cpu_threads

    device = (args.device or "cuda").strip().lower()
    if device not in ("auto", "cpu", "cuda", "mps") and not re.fullmatch(r"cuda:\d+", device):
        raise CliError(f"--device {safe_text(repr(args.device), limit=40)}: give auto, cpu, cuda, cuda:N or mps")
    device = "cpu" if device == "cpu" else "cuda"
    if args.cpu_threads is None:
        return device, app_cpu_threads()
    if device != "cpu":
        raise CliError("--cpu-threads is the CPU's torch threads: give it with --device cpu")
    return device, args.cpu_threads


def cmd_calc(args: argparse.Namespace) -> int:
    from kvscope.core.model.sources import load_spec
    from kvscope.core.model.spec import parse_size, parse_tokens
    from kvscope.core.prediction.calc import calculate, render_json, render_table

    _refuse_empty_values(args)
    _check_amounts(args, "calc")
    require_stdout("calc prints its figures there (>/dev/null discards them)")
    contexts = [parse_tokens(c) for c in str(args.context).split(",") if c.strip()]
    if not contexts:
        raise CliError("--context needs at least one token count, e.g. 4k,32k")
    spec = load_spec(args.model)
    gpu = parse_size(args.gpu_memory) if args.gpu_memory else None
    settings = _settings_from(args)  # transformers' flags, checked whatever the runtime (a typo is said, not ignored)
    device, cpu_threads = _calc_device(args)
    vllm_options = _vllm_options(args)  # and vLLM's (--block-size -3 was ignored under any other runtime)
    if args.runtime != CALC_VLLM:  # a runtime of the registry with its own calc (and its own flags)
        from kvscope.core import runtimes

        own_calc = runtimes.get(args.runtime).hook("calc")
        if own_calc is not None:
            print(own_calc(args, spec, contexts, gpu))
            return 0
    from kvscope.core.prediction.parallel import Parallelism

    parallelism = Parallelism(args.tensor_parallel, args.pipeline_parallel)
    result = calculate(spec, settings, contexts, gpu, parallelism, device, cpu_threads)
    if args.runtime == CALC_VLLM:
        from dataclasses import replace

        from kvscope.core.prediction.serving import vllm_capacity

        if gpu is None:
            raise CliError("--runtime vllm needs --gpu-memory (each GPU's total memory, e.g. 24GiB)")
        result = replace(result, serving=vllm_capacity(spec, settings, gpu, vllm_options, parallelism))
    print(render_json(result) if args.json else render_table(result))
    return 0


#: The largest --prompt-file read: 4 MiB is about a million tokens, more than any model's context; /dev/zero
#: was read until the kernel killed the process.
MAX_PROMPT_FILE_BYTES = 4 << 20


def read_prompt_file(path: str) -> str:
    """The prompt in ``path``: a regular file (never a FIFO or a device, nor a link to one) of UTF-8 text, at most
    ``MAX_PROMPT_FILE_BYTES``; line ends as text mode reads them (\\r\\n and \\r as \\n). Raises a user error."""
    raw = read_regular_file(path, MAX_PROMPT_FILE_BYTES, f"--prompt-file {display_path(path)}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"--prompt-file {display_path(path)} is not UTF-8 text (it holds the byte "
                       f"0x{raw[exc.start]:02x}); save it as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _switch_token_not_negative(switch: str) -> str:
    """``--switch -5:attention=mqa`` (argparse took -5 for an option): the token T is said to be 0 or more."""
    if _DASH_VALUE.match(switch.strip()):
        raise CliError(f"--switch {safe_text(repr(switch), limit=80)}: T is the token to switch at, 0 or more; "
                       "write T:KEY=VALUE, e.g. 32:attention=mqa")
    return switch


def _run_request(args: argparse.Namespace):
    from kvscope.core.model.request import DEFAULT_PROMPT, RunRequest, check_seed
    from kvscope.core.model.spec import parse_size
    from kvscope.core.runtimes import parse_switch

    _refuse_empty_values(args)
    _check_amounts(args, "run")
    prompt = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    if args.tokens is not None and args.tokens <= 0:
        raise CliError("--tokens must be positive")
    # Output files are checked before torch is even imported (run_generation checks again, for the window's runs).
    for path, what in ((args.record, "cannot create recording: "), (args.snapshot, "--snapshot: ")):
        if path:
            try:
                check_output_path(path, inputs=(args.prompt_file,), force=args.force, allow_stdout=False)
            except OutputError as exc:
                raise CliError(f"{what}{exc}") from None
    if args.model and args.model.strip() != "embedded":  # a GGUF that cannot be read: calc's line, at once
        from kvscope.core.model.gguf import is_gguf_source, read_gguf

        if is_gguf_source(args.model.strip()):
            read_gguf(args.model.strip())
    from kvscope.core import runtimes

    # A model runs where it was made to run (a GGUF in the runtime that claims it) unless --runtime says otherwise.
    runtime = getattr(args, "runtime", None) or runtimes.runtime_for_source(args.model)
    from_flags = runtimes.get(runtime).hook("cli_options")  # the runtime's options, from its own flags
    options = {runtime: from_flags(args)} if from_flags is not None else {}
    _refuse_other_runtimes_flags(args, runtime)
    return RunRequest(
        runtime=runtime,
        options=options,
        source=args.model,
        device=args.device,
        dtype=args.dtype or "auto",
        prompt=prompt if prompt is not None else DEFAULT_PROMPT,
        max_new_tokens=args.tokens if args.tokens is not None else 128,
        settings=_settings_from(args),
        switches=tuple(parse_switch(_switch_token_not_negative(s), runtime) for s in args.switch),
        record_path=args.record,
        overwrite=args.force,
        trust_remote_code=args.trust_remote_code,
        allow_pickle=args.allow_pickle,
        memory_budget=parse_size(args.memory_budget) if args.memory_budget else None,
        snapshot_path=args.snapshot,
        seed=check_seed(args.seed),
        quality_probe=bool(getattr(args, "quality_probe", False)),
    )


def cmd_run(args: argparse.Namespace) -> int:
    request = _run_request(args)  # bad options and outputs are refused before torch is imported
    if not (0 <= args.metrics_linger <= 3600):  # also refuses NaN
        raise CliError("--metrics-linger: give 0 to 3600 seconds")
    from kvscope.core.live.load_watch import LoadWatch
    from kvscope.core.live.terminal import run_terminal

    collector, exporter = _start_metrics(args)
    watch = LoadWatch()  # SIGTERM / Ctrl+C before the model has loaded: one line, at once
    if exporter is None:
        with watch.armed():
            return run_terminal(request, observers=(watch.observe,))
    try:
        with watch.armed():
            status = run_terminal(request, observers=(watch.observe, collector.observe))
        collector.finish()
        if args.metrics_linger:
            import time

            print(f"kvscope: run ended; serving the metrics {args.metrics_linger:g} s more", file=sys.stderr, flush=True)
            time.sleep(args.metrics_linger)
        return status
    finally:
        exporter.stop()


def start_engine_early(request) -> None:
    """Start the engine process (and its first run's model loading) before the window's own imports: on a small
    machine torch and the model load meanwhile instead of after (``kvscope.core.live.engine_process.spawn_early``). Not when
    the engine runs on a thread of this process (KVSCOPE_ENGINE=thread)."""
    if os.environ.get("KVSCOPE_ENGINE", "").strip().lower() == "thread":
        return
    from kvscope.core.live.engine_process import spawn_early

    spawn_early(preload=request)


def cmd_gui(args: argparse.Namespace) -> int:
    request = _run_request(args)
    screenshot = args.screenshot
    if screenshot:
        # Checked before anything loads: an existing PNG needs --force, a device or folder never.
        screenshot = check_output_path(screenshot, inputs=(args.prompt_file,), force=args.force)
    start_engine_early(request)
    from kvscope.ui.app import display_problem, run_window

    problem = display_problem()
    collector, exporter = _start_metrics(args)
    observers = (collector.observe,) if collector is not None else ()
    try:
        if screenshot or problem is None:
            return run_window(request, screenshot=screenshot, tokens=args.tokens, observers=observers, **_view(args))
        print(f"kvscope: {problem}: running the terminal view instead. "
              "Use QT_QPA_PLATFORM=offscreen with --screenshot to render the window without a display.", file=sys.stderr)
        from kvscope.core.live.engine_process import discard_early
        from kvscope.core.live.terminal import run_terminal

        discard_early()

        return run_terminal(request, observers=observers)
    finally:
        if exporter is not None:
            exporter.stop()


def cmd_self_test(args: argparse.Namespace) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from kvscope.ui.app import self_test

    return self_test()


def cmd_watch(args: argparse.Namespace) -> int:
    import json

    from kvscope.core.records.scrape import ScrapeError, metrics_url, render_reading, watch

    if not (0.1 <= args.interval <= 3600):  # also refuses NaN
        raise CliError("--interval: give 0.1 to 3600 seconds")
    if not (0.1 <= args.timeout <= 60):
        raise CliError("--timeout: give 0.1 to 60 seconds")
    if args.count is not None and args.count <= 0:
        raise CliError("--count must be positive")
    require_stdout("watch prints its readings there (>/dev/null discards them)")
    if not (0 < args.warn_usage <= 1):
        raise CliError("--warn-usage: give a fraction in (0, 1]")
    try:
        for url in args.urls:
            metrics_url(url)
    except ScrapeError as exc:
        raise CliError(str(exc)) from None
    spec = None
    if args.model:
        from kvscope.core.model.sources import load_spec

        spec = load_spec(args.model)

    def emit(reading) -> None:
        print(json.dumps(reading.to_json()) if args.json else render_reading(reading), flush=True)

    try:
        watch(args.urls, spec=spec, interval=args.interval, count=args.count, timeout=args.timeout,
              warn_usage=args.warn_usage, emit=emit)
    except KeyboardInterrupt:
        pass  # Ctrl+C ends a watch: not an error
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.core.records.recording import read_header

    # A missing, empty, foreign or too-new file gets its one-line reason before Qt starts.
    read_header(args.file)
    # So does a PNG that would replace the recording, a device, a folder, or an existing file without --force.
    screenshot = check_output_path(args.screenshot, inputs=(args.file,), force=args.force) if args.screenshot else None
    from kvscope.ui.app import display_problem, run_replay

    problem = None if args.screenshot else display_problem()
    if problem is not None:
        raise CliError(f"replay needs a window: {problem} (or --screenshot out.png renders offscreen)")
    if args.speed <= 0:
        raise CliError("--speed must be positive")
    return run_replay(args.file, speed=args.speed, screenshot=screenshot, **_view(args))


def cmd_export(args: argparse.Namespace) -> int:
    from kvscope.core.records.export import write_csv
    from kvscope.core.records.recording import RecordingReader

    if not args.csv:
        raise CliError("export needs an output: --csv out.csv")
    # One summary line about skipped or cut-off samples (reader.problem()), the same line a replay
    # prints; the reader logs each damaged line at debug level only.
    with RecordingReader(args.file) as reader:
        # Before any row: never over the recording itself, a device or a folder; an existing file needs --force.
        out = check_output_path(args.csv, inputs=(args.file,), force=args.force)
        rows = write_csv(reader, out)
        problem = reader.problem()
    # With the CSV on standard output, the note goes to stderr so the CSV stays clean.
    print(f"wrote {rows:,} samples to {out.shown}", file=sys.stderr if out.stdout else sys.stdout)
    if problem:
        print(f"kvscope: {safe_text(problem)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    hold_closed_descriptors()  # `>&-`: no file opened below may take descriptor 1 (C code would print into it)
    parser = build_parser()
    try:
        args = parser.parse_args(glue_dash_values(parser, list(sys.argv[1:] if argv is None else argv)))
    except CliError as exc:  # a whole number option's own refusal (_whole_number)
        print(f"kvscope: {safe_text(exc)}", file=sys.stderr)
        return 2
    if args.screenshot and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    commands = {"calc": cmd_calc, "run": cmd_run, "watch": cmd_watch, "replay": cmd_replay, "export": cmd_export}
    handler = commands.get(args.command or "", cmd_self_test if args.self_test else cmd_gui)
    try:
        with guard_stdout():  # a full or failing standard output is one line (kvscope.core.base.streams)
            return handler(args)
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except Exception as exc:  # decided by type (kvscope.core.base.errors): one line for the user's errors, a traceback for ours
        if os.environ.get("KVSCOPE_DEBUG"):
            raise
        if not is_user_error(exc):
            import traceback

            traceback.print_exc()
            print(f"kvscope: internal error: {type(exc).__name__}: {safe_text(exc)}", file=sys.stderr)
            return 1
        print(f"kvscope: {safe_text(exc)}", file=sys.stderr)  # messages name files and quote what they hold
        return 2


if __name__ == "__main__":
    # The window runs the model in a child process (spawned: kvscope.core.live.engine_process.serve). In the packaged app
    # that child is this same executable; freeze_support turns such a start into the child's work.
    import multiprocessing

    multiprocessing.freeze_support()
    sys.exit(main())
