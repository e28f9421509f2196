"""The ``fedmosaic`` command. Everything that stops it ends as one line on stderr, never as a traceback:

- exit 2: a mistake in the input (config, options, files) or a failure of the machine (disk full, out of memory);
- exit 130 / 143: interrupted by SIGINT / SIGTERM (the line says which run directory to resume);
- exit 3: a bug in fedmosaic. ``FEDMOSAIC_TRACEBACK=1`` shows the traceback of any of these.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
import warnings
from pathlib import Path

from .. import plugins
from ..errors import FedMosaicError, RunError, Stopped, environment_error, one_line
from ..presets import config_path
from ..version import __version__

MAX_MESSAGE = 1000


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds (temporary files removed) like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_unwinds():
    def handler(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(e: KeyboardInterrupt, what: str) -> Stopped:
    sig = signal.SIGTERM if isinstance(e, _Terminated) else signal.SIGINT
    return Stopped(f"interrupted by {sig.name}; {what}", 128 + sig)


def _deploy(args) -> None:
    from ..config import load_config
    from ..deploy.common import flower
    from ..deploy.prepare import prepare
    from ..paths import data_dirs

    flower()  # before anything is written: one line if the extra is missing
    cfg = load_config(config_path(args.config), args.set)
    data = os.pathsep.join(str(Path(d).absolute()) for d in data_dirs())
    print(prepare(cfg, Path(args.out), host=args.host, port=args.port, link_port=args.link_port,
                  node_port=args.node_port, data_dir=data), end="")


def _gateway(args) -> None:
    from cryptography.exceptions import UnsupportedAlgorithm

    from ..deploy.common import flower
    from ..deploy.gateway import check_listening, node_keys, serve
    from ..deploy.prepare import check_host

    flower()
    for flag, given in (("--listen", args.listen), ("--superlink", args.superlink)):
        host, _, port = given.rpartition(":")
        if not port.isdigit() or not 1 <= int(port) <= 65535 or host.startswith("[") != host.endswith("]"):
            raise FedMosaicError(f"{flag}: {given[:80]!r} is not HOST:PORT (port 1-65535; IPv6 in brackets)")
        check_host(host.strip("[]"), flag)
    for f in (args.certfile, args.keyfile, args.ca, *([args.node_keys] if args.node_keys else [])):
        if not Path(f).is_file():
            raise FedMosaicError(f"gateway: {f} is not a file")
    if args.node_keys:
        try:
            node_keys(args.node_keys)()
        except (ValueError, TypeError, AttributeError, UnsupportedAlgorithm) as e:
            raise FedMosaicError(f"gateway: --node-keys {args.node_keys}: not a JSON object of PEM public keys "
                                 f"({one_line(e, 120)})") from None
    check_listening(args.listen, args.certfile, args.keyfile, args.ca)
    serve(args.listen, args.superlink, args.certfile, args.keyfile, args.ca, args.max_body_mb, args.node_keys)


def _run(args) -> None:
    from ..config import advise, algorithm_spec, load_config
    from ..reports.compare import run_all
    from ..runs.dirs import first_missing, new_run_dir, not_a_run, remove_made

    algorithms = getattr(args, "algorithms", None)
    updates = {"compare": [algorithm_spec(a) for a in algorithms]} if algorithms else {}
    if args.seeds:
        updates["seeds"] = args.seeds
    if args.amend and not args.resume:
        raise FedMosaicError("--amend: only with --resume RUN_DIR (it changes a run that exists)")
    if args.runs_dir and (args.out or args.resume):
        raise FedMosaicError(f"--runs-dir: where a new run directory goes when no --out names it; with "
                             f"{'--out' if args.out else '--resume'} it would be ignored: give one of them")
    if args.resume:
        if args.out or args.config:
            raise FedMosaicError("--resume: the run directory has its config; give no config file or --out with it")
        out = Path(args.resume)
        saved = next((out / f for f in ("seeds.yaml", "comparison.yaml", "config.yaml") if (out / f).is_file()),
                     None)
        if saved is None:
            raise FedMosaicError(not_a_run(out, "config.yaml, comparison.yaml or seeds.yaml"))
        cfg = load_config(saved, args.set, updates)
    else:
        saved = None
        cfg = load_config(config_path(args.config or "quickstart"), args.set, updates)
        if args.command == "compare" and not cfg.compare:
            raise FedMosaicError("compare: name the algorithms (--algorithms fedavg fedprox:mu=0.1) or give a config "
                                 "with a compare: list")
        advise(cfg, compare_given="compare" in updates)
    if args.check:
        _check(cfg, args, saved)
        return
    # a new directory is created (reserved) right away, so that runs started together never share one
    reserved = not (args.resume or args.out)
    runs_dir = args.runs_dir or "runs"
    made = first_missing(Path(runs_dir)) if reserved else None  # --runs-dir, where this command makes it
    out = Path(args.resume or args.out or new_run_dir(runs_dir, cfg.name))
    resume_cmd = f"fedmosaic run --resume {shlex.quote(str(out))}"
    # a run that stopped before its first round finished leaves nothing (runner.run): resume only what is there
    started = lambda: any((out / f).exists() for f in ("config.yaml", "comparison.yaml", "seeds.yaml"))  # noqa: E731

    def where() -> str:  # what the user can do with what is in `out`
        if any(p.is_file() and p.stat().st_size for p in out.rglob("metrics.jsonl")):
            return f"finished rounds are saved in {out}: continue with `{resume_cmd}`"
        return f"no round had finished yet: `{resume_cmd}` starts it" if started() else \
            "no round had finished, nothing was kept"

    try:
        summaries = run_all(cfg, out, resume=bool(args.resume), amend=args.amend, progress=not args.no_progress)
    except KeyboardInterrupt as e:
        raise _interrupted(e, where()) from None
    except RunError as e:
        if started():
            fix = f" --amend --set {e.amend}" if e.amend else ""
            raise FedMosaicError(f"{e}; continue with `{resume_cmd}{fix}`") from None
        raise FedMosaicError(f"{e}; no round had finished, nothing was kept" +
                             (f"; run it again with --set {e.amend}" if e.amend else "")) from None
    except Exception as e:
        problem = environment_error(e)
        if problem is None or not started():
            raise
        raise FedMosaicError(f"{problem}; {where()}") from e
    finally:
        if reserved:  # failed before writing anything: leave no empty folder, nor a --runs-dir made for it
            remove_made(out, made or out)
    _print_tables(summaries)
    print(f"\nrun directory: {out}\nlearning curves: {out / 'learning_curves.png'}")


def _reproduce(args) -> None:
    from ..reports.reproduce import REQUEST, load_paper, markdown, reproduce, seeds_judged

    if args.list:
        given = [f for f, v in (("--claims", args.claims), ("--seeds", args.seeds), ("--methods", args.methods),
                                ("--set", args.set), ("--out", args.out), ("--status", args.status)) if v]
        if given:
            raise FedMosaicError(f"--list: names every claim of {args.paper} with its experiment and cost, and runs "
                                 f"nothing; it takes --scale alone (got {', '.join(given)})")
        spec = load_paper(args.paper)
        for c in spec.claims:
            exp = spec.experiments[c.experiment]
            print(f"{c.id:18s} {c.text} ({c.source}; paper: {'–' if c.paper is None else c.paper}) "
                  f"[{c.experiment}: {exp.preset}, {exp.cost.get(args.scale, 'cost not estimated')}]")
        return
    out = Path(args.out or f"runs/reproduce-{args.paper}-{args.scale}")
    try:
        report = reproduce(args.paper, out, scale=args.scale, claims=args.claims, sets=args.set, seeds=args.seeds,
                           progress=not args.no_progress, status=args.status, methods=args.methods)
    except KeyboardInterrupt as e:
        raise _interrupted(e, f"finished rounds are kept: the same command resumes {out}" if (out / REQUEST).is_file()
                           else "nothing was written") from None
    if args.status:
        print(markdown(report), end="")
        return
    for c in report["claims"]:
        print(f"{c['id']:18s} {c['verdict']}{seeds_judged(c)}{': ' + c['why'] if c.get('why') else ''}")
    print(f"\nreproduction: {out / 'reproduction.md'}")


def _check(cfg, args, saved: Path | None) -> None:
    """``--check``: what the command would run, once its config is valid, its --out free and its data found;
    ``saved``: with --resume, the run directory's config file (a run's, a comparison's or a seeds directory's)."""
    from ..reports.reproduce import missing_data
    from ..runs.dirs import check_out, refuse_runs_dir

    if args.out and not args.resume:
        check_out(Path(args.out), resume=False)
    if saved is not None:  # what the resume itself refuses (a changed config without --amend, one --amend cannot make)
        from ..reports.compare import comparison_changes
        from ..runs.runner import resume_changes

        if saved.name == "config.yaml":
            resume_changes(saved.parent, cfg, args.amend)
        else:
            comparison_changes(saved.parent, saved.name, cfg, args.amend)
    if not (args.out or args.resume):  # where the run would make its folder
        refuse_runs_dir(Path(args.runs_dir or "runs"))
    if cfg.privacy is not None:
        from ..engine.accounting import accountant

        accountant()  # (what the run checks before reading data; a config alone does not need it)
    missing = missing_data(cfg)
    if missing:
        raise FedMosaicError(missing)
    seeds = f" x {len(cfg.seeds)} seeds" if cfg.seeds else ""
    print(f"ok: {cfg.name}: {len(cfg.variants())} run(s){seeds} of {cfg.train.rounds} rounds on {cfg.data.dataset} "
          "(found); nothing was run or written")


def _print_tables(summaries: list[dict]) -> None:
    from ..reports.compare import table, tasks_table, terms_table

    print(table(summaries))
    for part in (terms_table(summaries), tasks_table(summaries)):
        if part:
            print(f"\n{part}")


def _report(args) -> None:
    from ..reports.compare import from_runs
    from ..reports.plots import FORMATS, accuracy_per_task, diagnostics, diverged, learning_curves

    if args.title and not args.plot:
        raise FedMosaicError("--title: the title of the plot; give --plot FILE too")
    plot = Path(args.plot) if args.plot else None
    # beside it in the same format: class-incremental runs per task, the objective's parts and measures per round
    tasks, parts = (None, None) if plot is None else (plot.with_name(f"{plot.stem}-{kind}{plot.suffix}")
                                                      for kind in ("tasks", "diagnostics"))
    if plot is not None and plot.suffix.lower().lstrip(".") not in FORMATS:
        raise FedMosaicError(f"--plot {plot}: give a name ending in {', '.join('.' + f for f in FORMATS)} (the "
                             "format follows it)")
    for path in (plot, tasks, parts):
        if path is not None and (path.exists() or path.is_symlink()):
            raise FedMosaicError(f"--plot: {path} already exists; choose another file")
    above = next((d for d in (plot.parents if plot is not None else ()) if d.exists() or d.is_symlink()), None)
    if above is not None and not above.is_dir():  # (a file, or a link to nothing, where a folder must be)
        raise FedMosaicError(f"--plot {plot}: {above} is not a folder; choose another file")
    summaries, curves, notes = from_runs([Path(d) for d in args.runs], args.rounds)
    for n in notes:
        print(f"fedmosaic: warning: {n}", file=sys.stderr)
    _print_tables(summaries)
    if plot is not None:
        try:
            plot.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FedMosaicError(f"--plot {plot}: cannot make its folder ({e.strerror or e})") from None
        try:  # exclusive: a file that appeared since the check above is kept, not replaced
            stopped = diverged(summaries)
            learning_curves(curves, plot, title=args.title or "", exclusive=True, stopped=stopped)
            print(f"\nlearning curves: {plot}")
            if accuracy_per_task(summaries, tasks, title=args.title or "", exclusive=True):
                print(f"accuracy after each task: {tasks}")
            if diagnostics(curves, parts, title=args.title or "", exclusive=True, stopped=stopped):
                print(f"objective's parts and measures per round: {parts}")
        except FileExistsError as e:
            raise FedMosaicError(f"--plot: {e.filename} appeared while the report ran; it is kept, choose another "
                                 "file") from None


def _partition(args) -> None:
    import numpy as np

    from ..config import parse_value
    from ..data.federated import PartitionSpec, build, check_partition_dir
    from ..reports.plots import partition_bubbles

    params = {"scheme": args.scheme}
    for flag, key in (("alpha", "alpha"), ("shards", "shards_per_client"), ("k", "k"), ("min_size", "min_size")):
        if getattr(args, flag) is not None:
            params[key] = getattr(args, flag)
    for item in args.param:
        if "=" not in item:
            raise FedMosaicError(f"-p {item!r}: expected key=value, e.g. -p alpha=0.1")
        key, value = item.split("=", 1)
        params[key] = parse_value(value)
    try:
        classes = tuple(int(c) for c in args.classes.split(",")) if args.classes else None
    except ValueError:
        raise FedMosaicError(f"--classes {args.classes!r}: expected class ids separated by commas, e.g. 36,37,38")
    spec = PartitionSpec(args.dataset, args.clients, params, args.pool, args.test_frac, args.val_frac, args.seed,
                         classes)
    if args.out:
        check_partition_dir(Path(args.out))  # before the data are read: a folder of the user's is refused
    fd = build(spec, clients_field="--clients")
    s = fd.summary()
    scheme = params["scheme"]
    out = Path(args.out) if args.out else Path("partitions") / f"{args.dataset}-{scheme}-{fd.hash[:10]}"
    png = out / "partition.png"
    fd.save(out)  # (refuses a folder that holds anything but a partition, a lone partition.png too)
    if not png.exists():  # the same partition saved before keeps its plot
        described = ", ".join(f"{k}={v}" for k, v in params.items() if k != "scheme")
        partition_bubbles(s["counts"], png, title=f"{args.dataset} · {scheme}({described}) · {s['clients']} clients "
                          f"· seed {args.seed}")
    ent = s["entropy_mean_nats"]
    print(f"dataset      {args.dataset} ({fd.num_classes} classes)  scheme {params}  seed {args.seed}")
    print(f"clients      {s['clients']}")
    print(f"samples      total {s['samples_total']}  min {s['samples_min']}  median {s['samples_median']:g}  "
          f"max {s['samples_max']}  mean {s['samples_mean']:.1f}  std {s['samples_std']:.1f}")
    print(f"classes      per client min {s['classes_min']}  median {s['classes_median']:g}  max {s['classes_max']}")
    print(f"entropy      mean label entropy {ent:.3f} nats (uniform: {np.log(fd.num_classes):.3f})")
    if fd.ptr["test"][-1]:
        print(f"client test  {int(fd.ptr['test'][-1])} samples")
    print(f"hash         {fd.hash}")
    print(f"saved        {out}/  (manifest.json, partition.npz, partition.png)")


def _data_list(args) -> int:
    from ..data.registry import REGISTRY, _ensure_loaded, find_layout, missing_message

    _ensure_loaded()
    for name in sorted({s.name for s in REGISTRY.values()}):
        spec = REGISTRY[name]
        found = find_layout(spec)
        if spec.builtin:
            print(f"{name:18s} built-in")
        elif spec.parts and found:
            print(f"{name:18s} found   made of {', '.join(spec.parts)}")
        elif found:
            layout, folder = found
            size = sum((folder / f).stat().st_size for f in layout.files)
            where = (folder / layout.files[0]).resolve().parent
            print(f"{name:18s} found   {where}  [{layout.name}, {size / 2**20:.1f} MiB]")
        else:
            print(f"{name:18s} missing {missing_message(spec).split(': ', 1)[1]}")
    return _data_verify() if args.verify else 0


def _data_verify() -> int:
    """Verdict per dataset on stdout; each bad, missing or unreadable file (and pin warning) on stderr."""
    from ..data.verify import verify

    report = verify(progress=True)
    print()
    print("\n".join(report.summary()))
    for line in report.problems():
        print(f"fedmosaic: {line}", file=sys.stderr)
    return 1 if report.failed else 0


def _list(args) -> None:
    from ..reports.catalog import SECTIONS, catalog

    unknown = [w for w in args.what if w not in SECTIONS]
    if unknown:
        raise FedMosaicError(f"list: unknown section {unknown[0]!r}; allowed: {', '.join(SECTIONS)}")
    print(catalog(args.what or list(SECTIONS)))


def _data_download(args) -> None:
    from ..data.registry import load_dataset

    ds = load_dataset(args.name, download=True)
    print(f"{ds.name}: {len(ds.y_train)} train, {0 if ds.y_test is None else len(ds.y_test)} test")


def _at_least(low: int):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {text!r})")
        return int(text)

    return parse


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (a folder or file name is needed)")
    return text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1) (got {text!r})")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"fedmosaic: error: {_one_line(message)} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedmosaic", description="Federated learning when clients differ.")
    p.add_argument("--version", action="version", version=f"fedmosaic {__version__}")
    p.add_argument("--data-dir", help="data search path (folders separated by ':'); default $FEDMOSAIC_DATA")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE first, for the datasets and models it registers (repeatable; also "
                   "$FEDMOSAIC_PLUGINS and installed 'fedmosaic.plugins' entry points)")
    sub = p.add_subparsers(dest="command")

    r = sub.add_parser("run", help="run a config or preset (no argument: the quickstart comparison)")
    c = sub.add_parser("compare", help="several algorithms on one partition, cohorts and batch order; table + PNG")
    for q in (r, c):
        q.add_argument("config", nargs="?", help="YAML file or preset name (default: quickstart)")
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.rounds=5")
        q.add_argument("--out", type=_path, help="run directory (must not exist yet)")
        q.add_argument("--runs-dir", type=_path, help="where a new run directory goes when no --out names it "
                       "(default: ./runs)")
        q.add_argument("--resume", type=_path, metavar="RUN_DIR",
                       help="continue an interrupted run from its last checkpoint")
        q.add_argument("--amend", action="store_true",
                       help="with --resume: let --set change the learning rate, rounds, evaluation or engine settings "
                       "from the next round on (recorded in meta.json), e.g. after a divergence")
        q.add_argument("--seeds", nargs="+", type=_at_least(0), metavar="SEED",
                       help="run once per seed (each in <out>/seed_<s>); the table gives mean ± std, the curves a band")
        q.add_argument("--no-progress", action="store_true", help="no progress bar")
        q.add_argument("--check", action="store_true", help="validate the command, its config and that its data is "
                       "found; run and write nothing")
        q.set_defaults(fn=_run)
    c.add_argument("--algorithms", nargs="+", metavar="NAME[:K=V,...]",
                   help="e.g. fedavg fedprox:mu=0.1 fedntd:beta=1,tau=1 (default: the config's compare: list)")

    rr = sub.add_parser("reproduce", help="a seed paper's headline claims: run (or resume) the comparisons that test "
                        "them, then reproduction.md with the paper's number, ours and a verdict per claim")
    rr.add_argument("paper", help="apfl-pd, pfedsrb, ahf, protofcl or fedntd")
    rr.add_argument("--claims", nargs="+", metavar="ID", help="only these claims (default: all; --list names them)")
    rr.add_argument("--scale", choices=("cpu", "paper"), default="cpu",
                    help="cpu: the reduced setting (default); paper: the paper's own rounds and models")
    rr.add_argument("--seeds", nargs="+", type=_at_least(0), metavar="SEED", help="instead of the claims' seeds")
    rr.add_argument("--methods", nargs="+", metavar="NAME", help="run only these methods of each experiment (e.g. "
                    "pfedsrb; the others are left as they are, to run later or on another machine with the same "
                    "folder); the verdicts count every method that has finished")
    rr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override every experiment's config, e.g. train.rounds=2")
    rr.add_argument("--out", type=_path, help="its directory (default: runs/reproduce-PAPER-SCALE); the same command "
                    "again resumes it")
    rr.add_argument("--list", action="store_true", help="name the claims, their experiments and costs; run nothing")
    rr.add_argument("--status", action="store_true", help="while it runs (or after it stopped): how far each "
                    "experiment has got and each claim's verdict on the seeds where its methods have finished; "
                    "run and write nothing")
    rr.add_argument("--no-progress", action="store_true", help="no progress bar")
    rr.set_defaults(fn=_reproduce)

    dp = sub.add_parser("deploy", help="prepare a Flower deployment of a config: the app, TLS certificates, node "
                        "keys and the commands for a SuperLink and one SuperNode per client")
    dp.add_argument("config", help="YAML file or preset name")
    dp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.rounds=5")
    dp.add_argument("--out", type=_path, required=True,
                    help="a new directory for the deployment (must not exist yet)")
    dp.add_argument("--host", default="127.0.0.1", help="the SuperLink's address as nodes reach it (default "
                    "127.0.0.1; a machine's address or DNS name for real devices)")
    dp.add_argument("--port", type=int, default=9093, help="the port nodes reach: the fleet gateway's (default "
                    "9093)")
    dp.add_argument("--link-port", type=int, default=9092, help="the SuperLink's port on the server's loopback, for "
                    "the operator's flwr CLI and the gateway (default 9092)")
    dp.add_argument("--node-port", type=int, default=9094,
                    help="first SuperNode's local port; node K uses this + K (default 9094)")
    dp.set_defaults(fn=_deploy)

    gw = sub.add_parser("gateway", help="the fleet gateway of a deployment (commands.sh starts it): TLS on the "
                        "address nodes reach, only the Fleet API's node calls forwarded to the SuperLink on loopback")
    gw.add_argument("--listen", required=True, metavar="HOST:PORT")
    gw.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink (its loopback address)")
    gw.add_argument("--certfile", required=True)
    gw.add_argument("--keyfile", required=True)
    gw.add_argument("--ca", required=True, help="the CA that signed the SuperLink's certificate")
    gw.add_argument("--max-body-mb", type=_at_least(1), default=1024, metavar="MB",
                    help="refuse a node's request body over this, read or not (commands.sh: from deploy.max_reply_mb)")
    gw.add_argument("--node-keys", metavar="FILE", help="the deployment's node keys (the app's node_keys.json; read "
                    "again when it changes): a request not signed by one of them is refused before its body is read")
    gw.set_defaults(fn=_gateway)

    rp = sub.add_parser("report", help="table (and learning curves) of existing run directories, finished or not")
    rp.add_argument("runs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--rounds", type=_at_least(1), help="compare over the first N rounds of each run")
    rp.add_argument("--plot", type=_path, metavar="FILE", help="write the learning curves there (must not exist "
                    "yet): .png, .pdf or .svg; FILE-tasks and FILE-diagnostics beside it (per task; the objective's "
                    "parts and measures per round) where the runs have them")
    rp.add_argument("--title", help="title of the plot (with --plot)")
    rp.set_defaults(fn=_report)

    pt = sub.add_parser("partition", help="partition a dataset over clients, print a summary, save it with a PNG")
    pt.add_argument("--dataset", required=True)
    pt.add_argument("--clients", type=_at_least(1), default=None, help="number of clients (some schemes fix it)")
    pt.add_argument("--scheme", default="dirichlet")
    pt.add_argument("--alpha", type=float)
    pt.add_argument("--shards", type=int, help="shards per client (scheme shards)")
    pt.add_argument("--k", type=int, help="classes per client (scheme label_k)")
    pt.add_argument("--min-size", type=int)
    pt.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE", help="any scheme parameter")
    pt.add_argument("--pool", choices=("train", "all"), default="train")
    pt.add_argument("--test-frac", type=_fraction, default=0.0, help="per-client test fraction (stratified)")
    pt.add_argument("--val-frac", type=_fraction, default=0.0)
    pt.add_argument("--seed", type=_at_least(0), default=0)
    pt.add_argument("--classes", help="keep only these class ids, e.g. 36,37,...,45 (FEMNIST a-j)")
    pt.add_argument("--out", type=_path, help="directory for manifest.json, partition.npz and partition.png")
    pt.set_defaults(fn=_partition)

    ls = sub.add_parser("list", help="what can be named in a config: algorithms (with every hyper-parameter), models, "
                        "presets, datasets")
    ls.add_argument("what", nargs="*", help="only these sections: algorithms, models, presets, datasets (default: all)")
    ls.set_defaults(fn=_list)

    d = sub.add_parser("data", help="datasets: list what is found, download")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dl = dsub.add_parser("list", help="each dataset: found where, size, or which files are missing")
    dl.add_argument("--verify", action="store_true",
                    help="also check the files' SHA-256 against SHA256SUMS files and the registry's pins; "
                    "exit 1 if any is bad, missing or unreadable")
    dl.set_defaults(fn=_data_list)
    dd = dsub.add_parser("download", help="download a dataset from its canonical source (SHA-256 checked)")
    dd.add_argument("name")
    dd.set_defaults(fn=_data_download)
    _global_options_anywhere(p)
    return p


def _global_options_anywhere(parser: argparse.ArgumentParser) -> None:
    """``--data-dir`` and ``--plugin`` are the command's, but messages suggest them where a user types them — after
    the subcommand too (``fedmosaic run --plugin my_plugin ...``): every subcommand takes them as well."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                sp.add_argument("--data-dir", dest="data_dir_here", default=argparse.SUPPRESS,
                                help="as fedmosaic --data-dir")
                sp.add_argument("--plugin", dest="plugin_here", action="append", default=argparse.SUPPRESS,
                                metavar="MODULE", help="as fedmosaic --plugin")
                _global_options_anywhere(sp)


def _load_plugins(args) -> None:
    """Import the plug-ins (``--plugin``, $FEDMOSAIC_PLUGINS, entry points), and note those that the runs this
    command reads were made with, so that an unknown dataset or model there names the one to pass."""
    if os.getcwd() not in sys.path:  # the command's path has its own folder, not the user's: find a module there
        sys.path.append(os.getcwd())  # as `python -m` would, last, so that it shadows nothing installed
    plugins.load(args.plugin)
    plugins.expect([Path(d) for d in [*getattr(args, "runs", []), getattr(args, "resume", None)] if d])


def _one_line(text: str) -> str:
    return one_line(text, MAX_MESSAGE)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"fedmosaic: warning: {_one_line(message)}", file=sys.stderr)


class _StderrLog(logging.Handler):
    """fedmosaic's log warnings as one ``fedmosaic: warning:`` line each (sys.stderr looked up at each record)."""

    def emit(self, record):
        print(f"fedmosaic: {record.levelname.lower()}: {_one_line(record.getMessage())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:  # bare `fedmosaic` (with only global options) behaves like `fedmosaic run`
            args = parser.parse_args([*(sys.argv[1:] if argv is None else argv), "run"])
    except SystemExit as e:  # --help, --version, or a usage error (already printed in one line)
        return int(e.code or 0) if isinstance(e.code, int) else 2
    from ..paths import set_data_dirs

    if getattr(args, "data_dir_here", None) is not None:  # given after the subcommand
        args.data_dir = args.data_dir_here
    args.plugin = [*args.plugin, *getattr(args, "plugin_here", [])]

    if args.data_dir is not None and not args.data_dir.strip(os.pathsep + " "):
        print("fedmosaic: error: --data-dir: must name at least one folder", file=sys.stderr)
        return 2
    # --data-dir holds for this command only: main() called again in this process (tests, notebooks) starts afresh
    data_dirs_before = set_data_dirs(args.data_dir) if args.data_dir is not None else None
    debug = bool(os.environ.get("FEDMOSAIC_TRACEBACK"))
    logging.getLogger("matplotlib").setLevel(logging.ERROR)  # e.g. an unwritable ~/.config: not the user's problem
    log, handler = logging.getLogger("fedmosaic"), _StderrLog(logging.WARNING)
    log.addHandler(handler)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            with _sigterm_unwinds():
                from ..engine.client.threads import omp_threads

                omp_threads()  # (before torch is imported: OpenMP reads it then)
                _load_plugins(args)
                status = args.fn(args)
                sys.stdout.flush()  # a reader that went away shows here, not in Python's flush at exit
        except BrokenPipeError:
            # the reader stopped reading (`fedmosaic list | head`): end quietly with 128 + SIGPIPE, as
            # `yes | head` does; the rest of stdout goes to /dev/null, so the flush at exit cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except FedMosaicError as e:
            if debug:
                raise
            print(f"fedmosaic: error: {_one_line(e)}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt as e:
            stopped = _interrupted(e, "nothing is left half-written")
            print(f"fedmosaic: error: {stopped}", file=sys.stderr)
            return stopped.exit_code
        except Exception as e:
            if debug:
                raise
            problem = environment_error(e)
            if problem is not None:
                print(f"fedmosaic: error: {_one_line(problem)}", file=sys.stderr)
                return 2
            if "randomness error mode" in str(e):  # vmap met a random op its model draws (functional dropout)
                print("fedmosaic: error: the model draws random numbers in its forward pass (dropout?), which vmap "
                      "cannot draw per client; set engine.backend: sequential (or use nn.Dropout layers, which "
                      "choose it)", file=sys.stderr)
                return 2
            where = plugins.blame(e)
            if where is not None:  # the user's code, not ours
                print(f"fedmosaic: error in plug-in code ({where}): {_one_line(f'{type(e).__name__}: {e}')} "
                      "(FEDMOSAIC_TRACEBACK=1 shows the traceback)", file=sys.stderr)
                return 2
            print(f"fedmosaic: internal error: {_one_line(f'{type(e).__name__}: {e}')} -- this is a bug in "
                  "fedmosaic; please report it with the command (FEDMOSAIC_TRACEBACK=1 shows where)", file=sys.stderr)
            return 3
        finally:
            log.removeHandler(handler)
            if args.data_dir is not None:
                set_data_dirs(data_dirs_before)
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
