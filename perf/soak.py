"""A bounded soak of a real tritonserver on loopback: mixed traffic for a fixed time, one llm stub killed halfway,
and what the server looks like afterwards.

    .venv/bin/python perf/soak.py [--duration 600] [--out perf/results/soak.json] [--model-repository DIR]

It starts its own server through the launcher (`python -m trellm_backend.tools.launch`, so the supervisor that
restarts a server whose stub died is the real one) on a private copy of the model repository, whose llm admits few
requests (`max_num_seqs` 8, `max_queue_size` 16) and whose vllm_model serves 16 streams at once (`--set
MODEL.KEY=VALUE` changes any config.pbtxt parameter), so that bursts really meet the limits. Then, for `--duration`
seconds, `--workers` threads each take the next action of a shuffled deck that holds every kind below:

- well-formed: gRPC streams to `ensemble` (text, chat messages, sampling, stop words, n=2; streamed and not), `llm`
  (token ids) and `vllm_model`; HTTP generate and generate_stream;
- malformed: wrong types, values out of range, empty and oversize prompts, invalid UTF-8, too many or too long
  bad/stop words, token ids outside the vocabulary, broken JSON, unknown fields and models, a unary gRPC infer on
  a decoupled model; each must be refused;
- cancels: gRPC stream cancel (llm, vllm_model, ensemble), a cancel right after sending, LLMClient and
  AsyncLLMClient leaving early (they send the stop request), an explicit stop request for an ensemble request;
- disconnects: the gRPC channel closed mid-stream, a client process killed (kill -9) mid gRPC stream and mid HTTP
  generate_stream, the HTTP socket closed mid generate_stream, closed before a generate's answer, and closed
  halfway through sending a request body;

while another thread sends an overload burst (`--burst-size` requests at once on one target, cycling llm,
ensemble, vllm_model and HTTP generate) every `--burst-every` seconds. At `--kill-at` of the duration the workers
pause until the server is idle (KV blocks, running and waiting requests all 0: the first half's leak check), resume,
and three long streams (ensemble, llm, vllm_model) start; then the llm stub is killed with SIGKILL. The streams must
fail at once, and a probe measures the recovery (kill -> first successful generate). Traffic goes on at least
`--after-recovery` seconds after it.

Every request has a deadline (`--deadline`, 60 s): one that neither finishes nor fails by then is hung. At the end:
the server idle again (the llm's `trellm:kv_cache_used_blocks`, `vllm:num_requests_running` and
`vllm:num_requests_waiting` all 0 within `--idle-timeout`), vllm_model's slots all free (a burst of exactly
`max_concurrent_requests` is served without a refusal), the resident memory of tritonserver and its stubs at the
start (after a warm-up), before the kill, after the recovery and at the end (and every `--rss-every` s), TTFT
percentiles of well-formed streams, the outcome of every request by kind and error class, the server log's error
lines, tracebacks and crashes, and the /dev/shm regions of this run's stubs still there after the launcher stopped.
Exit status 1 when the verdict lists a failure (perf/soak_verdict.py says which findings are failures and which are
only "unexpected"): among them a request that hung, a KV block or request in use at idle, a vllm_model slot kept,
no recovery, a malformed request served, a well-formed one failing outside the restart, a /dev/shm region left, a
crash in the server log. `--out` writes the summary as JSON.

The parts: soak_server.py (the launcher process, RSS, /dev/shm, metrics), soak_requests.py (one request and its
outcome), soak_traffic.py (the kinds of traffic), soak_verdict.py (the summary and the verdict); this file runs them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

from soak_requests import Record, StreamOutcome, child, ensemble_inputs, is_connection_error, llm_inputs, vllm_inputs
from soak_server import Launcher, shm_left
from soak_traffic import Traffic
from soak_verdict import print_summary, summarize
from trellm_backend.tools.repository import read_config
from trellm_backend.tools.testbed import private_repository

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REPOSITORY = os.path.join(REPO, "model_repository")
DEFAULT_MODEL = os.path.join(REPO, "hf_models", "tiny-llama")
# Private-copy settings: few sequence slots and a short queue, so a burst meets both limits.
DEFAULT_SETTINGS = {"llm": {"max_num_seqs": "8", "max_queue_size": "16"},
                    "vllm_model": {"max_concurrent_requests": "16"}}
IDLE_GAUGES = ("trellm:kv_cache_used_blocks", "vllm:num_requests_running", "vllm:num_requests_waiting")


def parameter(repo: str, model: str, key: str) -> str | None:
    """A config.pbtxt parameter of `model` in `repo` (None when it is not set, or there is no such model)."""
    try:
        params = read_config(os.path.join(repo, model, "config.pbtxt")).parameters
    except OSError:
        return None
    return params[key].string_value if key in params else None


class Soak(Traffic):
    """The run: workers on a shuffled deck of every kind of traffic, the bursts, the RSS sampler, the stub kill and
    the recovery, and the checks at the end."""

    def __init__(self, args, launcher: Launcher, vocab_size: int, prompt_char_limit: int):
        super().__init__(args, launcher, vocab_size, prompt_char_limit)
        self.inflight: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.down = threading.Event()         # between the kill and the recovery: bursts wait
        self.deck: list = []
        self.deck_rng = random.Random(args.seed)
        self.kill: dict = {}
        self.kill_log_span: tuple[int, int] | None = None    # where the server log was at the kill and the recovery
        self.rss: dict[str, dict] = {}
        self.rss_timeline: list[dict] = []      # {"t": s, "total": MiB, per process: MiB} every --rss-every s
        self.shm_regions: dict[str, str] = {}   # named by the stubs of every server of this run: their owners
        self.shm_left: dict[str, str] = {}
        self.idle: dict[str, dict] = {}
        self.stuck: list[dict] = []
        self.left_out: dict[str, str] = {}      # kinds left out of the deck, with why (--kinds names them back in)
        self.stack_dump: dict = {}              # the server's stacks, taken once when a request is about to hang

    def begin(self, kind: str) -> int:
        token = uuid.uuid4().int
        with self.lock:
            self.inflight[token] = (kind, self.now())
        return token

    def end(self, token: int) -> None:
        with self.lock:
            self.inflight.pop(token, None)

    def sample(self, name: str | None) -> dict:
        """The RSS of the server and its stubs now (kept under `name` unless it is None), and the /dev/shm regions
        of its stubs."""
        rss = self.server.rss()
        if name:
            self.rss[name] = rss
        self.shm_regions.update(self.server.stub_regions())
        return rss

    def build_deck(self) -> list:
        """One round: every malformed, cancel and disconnect kind once, every well-formed kind
        `--wellformed-copies` times, shuffled."""
        deck = []
        for category, kinds, copies in (("wellformed", self.wellformed(), self.args.wellformed_copies),
                                         ("malformed", self.malformed(), 1), ("cancel", self.cancels(), 1),
                                         ("disconnect", self.disconnects(), 1)):
            for name, fn in kinds.items():
                if name in self.args.kinds or (not self.args.kinds and name not in self.left_out):
                    deck += [(category, name, fn)] * copies
        self.deck_rng.shuffle(deck)
        return deck

    def next_action(self):
        with self.lock:
            if not self.deck:
                self.deck = self.build_deck()
            return self.deck.pop()

    def run_action(self, category, kind, fn, rng) -> Record:
        token = self.begin(kind)
        start = self.now()
        try:
            res = fn(rng)
            if category == "wellformed":
                res, streamed = res
            else:
                streamed = False
        except Exception as e:  # noqa: BLE001 - a client-side failure is an outcome too, never a dead worker
            res, streamed = StreamOutcome(f"client exception {type(e).__name__}", message=repr(e)), False
        finally:
            self.end(token)
        outcome = res.outcome
        if category == "malformed" and outcome == "ok":
            outcome = "accepted"
        return self.record(kind, category, outcome, start, res.ttft if (streamed and outcome == "ok") else None,
                           res.message)

    def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        while not self.stop.is_set():
            if self.pause.is_set():
                time.sleep(0.05)
                continue
            category, kind, fn = self.next_action()
            r = self.run_action(category, kind, fn, rng)
            if is_connection_error(r.outcome) or "not healthy" in r.outcome:
                time.sleep(0.5)      # the server is away (the kill): retry a little later, as a client would
            else:
                time.sleep(rng.uniform(0, 0.05))

    def burster(self) -> None:
        targets = self.bursts()
        i = 0
        next_at = self.now() + min(2.0, self.args.burst_every)
        while not self.stop.is_set():
            if self.pause.is_set() or self.down.is_set() or self.now() < next_at:
                time.sleep(0.1)
                continue
            kind = targets[i % len(targets)]
            token = self.begin(kind)
            try:
                self.burst(kind, self.args.burst_size)
            finally:
                self.end(token)
            i += 1
            next_at = self.now() + self.args.burst_every

    def watchdog(self) -> None:
        """Once a request has gone half its deadline without an answer, take the server's stacks (once a run):
        what a hang's report needs and a later look at the server cannot give."""
        while not self.stop.wait(1.0) and not self.stack_dump:
            now = self.now()
            with self.lock:
                late = sorted({kind for kind, started in self.inflight.values()
                               if now - started > self.deadline / 2 and not kind.startswith("kill_inflight")})
            if late:
                path = os.path.join(self.server.root, "stacks.txt")
                self.stack_dump = {"at_s": round(now, 1), "late_kinds": late, "path": path}
                self.stack_dump["python"] = self.server.dump_stacks(path)

    def rss_sampler(self) -> None:
        while not self.stop.wait(self.args.rss_every):
            self.rss_timeline.append({"t": round(self.now(), 1), **self.sample(None)})

    def wait_idle(self, timeout: float) -> dict:
        """Poll the engine's gauges until KV blocks, running and waiting requests are all 0."""
        start = time.monotonic()
        last: dict = {}
        while True:
            try:
                m = self.server.metrics()
                last = {g: m.get(self.llm, {}).get(g) for g in IDLE_GAUGES}
            except OSError as e:
                last = {"error": str(e)}
            if all(last.get(g) == 0 for g in IDLE_GAUGES):
                return {"idle": True, "after_s": round(time.monotonic() - start, 2), **last}
            if time.monotonic() - start > timeout:
                return {"idle": False, "after_s": round(time.monotonic() - start, 2), **last}
            time.sleep(0.2)

    def wait_no_inflight(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if not self.inflight:
                    return True
            time.sleep(0.05)
        return False

    def kill_stub(self) -> None:
        """Pause the traffic until idle (the first half's leak check), resume it, open three long streams, kill
        the llm stub, and time the failures and the recovery."""
        k = self.kill
        self.pause.set()
        k["paused_at_s"] = round(self.now(), 1)
        k["drained"] = self.wait_no_inflight(self.deadline + 10)
        self.idle["before_kill"] = self.wait_idle(self.args.idle_timeout)
        self.sample("before_kill")
        self.pause.clear()
        streams = {"ensemble": lambda: self.grpc_stream(self.ensemble, ensemble_inputs(
                       "Once upon a time", max_tokens=2000, min_tokens=2000, stream=True), deadline=self.deadline),
                   "llm": lambda: self.grpc_stream(self.llm, llm_inputs([1, 100, 200, 300], max_tokens=2000,
                                                                         ignore_eos=True, stream=True))}
        if self.vllm:
            streams["vllm_model"] = lambda: self.grpc_stream(self.vllm, vllm_inputs(
                "Once upon a time", {"max_tokens": 2000, "ignore_eos": True}))
        ended: dict[str, tuple[float, StreamOutcome]] = {}

        def run(name, fn):
            start = self.now()
            token = self.begin(f"kill_inflight_{name}")
            try:
                res = fn()
            finally:
                self.end(token)
            ended[name] = (time.monotonic(), res)
            self.record(f"kill_inflight_{name}", "kill", res.outcome, start, message=res.message)
        threads = [threading.Thread(target=run, args=item, daemon=True) for item in streams.items()]
        for t in threads:
            t.start()
        time.sleep(2.0)                       # the streams are running (and the workers busy) when the stub dies
        stubs = [pid for pid, (name, _) in self.server.processes().items() if name == f"stub:{self.llm}"]
        if len(stubs) != 1:   # e.g. the stub died by itself and the supervisor is restarting the server
            k["error"] = (f"expected one {self.llm} stub, found {stubs}; "
                          f"supervisor so far: {self.server.supervisor_lines()}")
            return
        self.down.set()
        log_at_kill = self.server.log_size()
        os.kill(stubs[0], signal.SIGKILL)
        killed = time.monotonic()
        k.update(stub_pid=stubs[0], killed_at_s=round(self.now(), 2))
        for t in threads:
            t.join(self.deadline + 5)
        k["inflight_streams"] = {n: {"outcome": r.outcome, "responses": r.responses,
                                     "ended_after_kill_s": round(t - killed, 2)} for n, (t, r) in ended.items()}
        # Recovery: the first successful generate after the kill.
        probes = Counter()
        while time.monotonic() - killed < self.args.recovery_timeout:
            start = self.now()
            res = self.grpc_stream(self.ensemble, ensemble_inputs("Hello", max_tokens=2, stream=False), deadline=20)
            self.record("recovery_probe", "recovery", res.outcome, start, message=res.message)
            probes[res.outcome] += 1
            if res.outcome == "ok":
                k["recovered_after_s"] = round(time.monotonic() - killed, 2)
                k["recovered_at_s"] = round(self.now(), 2)
                break
            time.sleep(0.25)
        k["probes"] = dict(probes)
        self.kill_log_span = (log_at_kill, self.server.log_size())
        self.down.clear()
        if "recovered_after_s" in k:
            self.sample("after_recovery")

    def run(self) -> None:
        self.t0 = time.monotonic()
        workers = [threading.Thread(target=self.worker, args=(i,), daemon=True) for i in range(self.args.workers)]
        burster = threading.Thread(target=self.burster, daemon=True)
        helpers = [threading.Thread(target=f, daemon=True) for f in (self.rss_sampler, self.watchdog)]
        for t in workers + [burster] + helpers:
            t.start()
        kill_at = self.args.duration * self.args.kill_at
        while self.now() < kill_at:
            time.sleep(0.2)
        if not self.args.no_kill:
            self.kill_stub()
        end_at = self.args.duration
        if "recovered_at_s" in self.kill:
            end_at = max(end_at, self.kill["recovered_at_s"] + self.args.after_recovery)
        while self.now() < end_at:
            time.sleep(0.2)
        self.stop.set()
        self.traffic_s = round(self.now(), 1)
        for t in workers + [burster]:
            t.join(self.deadline + 15)
        with self.lock:
            self.stuck = [{"kind": kind, "since_s": round(self.now() - started, 1)}
                          for kind, started in self.inflight.values()]

    def final_checks(self) -> None:
        self.idle["end"] = self.wait_idle(self.args.idle_timeout)
        self.sample("end")
        if self.vllm:
            slots = int(parameter(self.server.repo, self.vllm, "max_concurrent_requests") or 256)
            n = len(self.records)
            records = self.burst("burst_grpc_vllm", min(slots, 64), max_tokens=4)
            del self.records[n:]          # not traffic of the soak: a check
            self.vllm_slots = {"requests": len(records), "served": sum(r.outcome == "ok" for r in records),
                               "refused": dict(Counter(r.outcome for r in records if r.outcome != "ok"))}
            self.idle["after_slot_check"] = self.wait_idle(self.args.idle_timeout)
        try:
            self.final_metrics = self.server.metrics().get(self.llm, {})
        except OSError:
            self.final_metrics = {}


CANCEL_AFTER_FINAL_FIXED_IN = (2, 57, 0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    ap.add_argument("--model-repository", default=DEFAULT_REPOSITORY,
                    help="repository to copy and serve (default: the checkout's, on hf_models/tiny-llama)")
    ap.add_argument("--model", default="ensemble",
                    help="the ensemble entry (an added model's name: its NAME_llm and NAME_vllm_model are used)")
    ap.add_argument("--set", action="append", default=[], metavar="MODEL.KEY=VALUE",
                    help="a config.pbtxt parameter of the private copy (defaults: llm.max_num_seqs=8, "
                         "llm.max_queue_size=16, vllm_model.max_concurrent_requests=16)")
    ap.add_argument("--workers", type=int, default=4, help="threads sending the mixed traffic (default 4)")
    ap.add_argument("--wellformed-copies", type=int, default=3,
                    help="copies of each well-formed kind per round of the deck (others: 1; default 3)")
    ap.add_argument("--deadline", type=float, default=60.0, help="a request not done after this many s is hung")
    ap.add_argument("--burst-size", type=int, default=50)
    ap.add_argument("--burst-every", type=float, default=None,
                    help="seconds between overload bursts (default: duration/8, at most 20)")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the duration when the stub dies")
    ap.add_argument("--no-kill", action="store_true", help="no stub kill")
    ap.add_argument("--after-recovery", type=float, default=10.0,
                    help="traffic goes on at least this many s after the recovery, past --duration if needed")
    ap.add_argument("--recovery-timeout", type=float, default=300.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="how long the server may take to become idle")
    ap.add_argument("--base-port", type=int, default=0,
                    help="Triton's HTTP port (gRPC +1, metrics +2, the front door +3, its gRPC relay +4); default: "
                         "free ports")
    ap.add_argument("--direct-http", action="store_true",
                    help="no front door: the HTTP traffic goes straight to Triton's (loopback) HTTP port")
    ap.add_argument("--grpc-through-door", action="store_true",
                    help="send the gRPC traffic to the front door's gRPC relay instead of Triton's own port")
    ap.add_argument("--rss-every", type=float, default=15.0, help="seconds between RSS samples (the timeline)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", type=lambda v: [k for k in v.split(",") if k], default=[],
                    help="only these kinds of traffic, comma-separated (bisecting which kind grows memory); bursts "
                         "still run unless --burst-size 0")
    ap.add_argument("--work-dir", default=None, help="where the repository copy and logs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (kept anyway when the soak fails)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.burst_every is None:
        args.burst_every = min(20.0, max(2.0, args.duration / 8))
    settings = {m: dict(s) for m, s in DEFAULT_SETTINGS.items()}
    for item in args.set:
        m = re.fullmatch(r"([^.=]+)\.([^=]+)=(.*)", item)
        if not m:
            ap.error(f"--set {item!r}: expected MODEL.KEY=VALUE")
        settings.setdefault(m.group(1), {})[m.group(2)] = m.group(3)
    if args.model != "ensemble":
        settings = {(f"{args.model}_{m}" if m in ("llm", "vllm_model") else m): s for m, s in settings.items()}
    args.settings = settings
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        how, port, target, model, vocab = argv[1:6]
        child(how, int(port), target, model, int(vocab))
        return 0
    args = parse_args(argv)
    root = args.work_dir or tempfile.mkdtemp(prefix="trellm-soak-")
    os.makedirs(root, exist_ok=True)
    repo = private_repository(args.model_repository, os.path.join(root, "model_repository"), args.settings)
    llm = "llm" if args.model == "ensemble" else f"{args.model}_llm"
    model_path = parameter(repo, llm, "model_path")
    if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
        if model_path and os.path.normpath(model_path) == os.path.normpath(DEFAULT_MODEL):
            from trellm_backend.tools.default_model import build
            build(DEFAULT_MODEL)
        else:
            print(f"error: {llm}'s model_path {model_path} holds no config.json", file=sys.stderr)
            return 2
    from trellm_backend.triton.tokenization import prompt_char_limit
    with open(os.path.join(model_path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]

    launcher = Launcher(repo, root, args.base_port, args.direct_http, args.grpc_through_door)
    print(f"soak: serving {repo} (log {launcher.log}) on HTTP {launcher.traffic_http_port}"
          f"{' (the front door)' if launcher.door_port else ''}, gRPC {launcher.traffic_grpc_port}"
          f"{' (the front door)' if launcher.door_grpc_port else ''}, "
          f"metrics {launcher.metrics_port}", flush=True)
    left: list[int] = []
    summary = None
    try:
        startup_s = launcher.start()
        soak = Soak(args, launcher, vocab_size, prompt_char_limit(model_path))
        if launcher.server_version() < CANCEL_AFTER_FINAL_FIXED_IN:
            soak.left_out["grpc_cancel_after_final"] = (
                "tritonserver before 2.57 keeps the state of a gRPC stream cancelled just after its final response "
                "(server#8078); run it alone with --kinds grpc_cancel_after_final")
        for kind, why in soak.left_out.items():
            print(f"soak: {kind} left out: {why}", flush=True)
        rng = random.Random(args.seed)
        for name, fn in soak.wellformed().items():         # warm-up: every path once, not counted
            res, _ = fn(rng)
            if res.outcome != "ok":
                print(f"warm-up {name}: {res.outcome} {res.message}", file=sys.stderr, flush=True)
        soak.sample("start")
        print(f"soak: server ready after {startup_s:.1f} s; {args.duration:.0f} s of traffic begins", flush=True)
        soak.run()
        soak.final_checks()
        left = launcher.stop()
        time.sleep(1)
        soak.shm_left = shm_left(soak.shm_regions)
        command = " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0].startswith(REPO) else sys.argv[0],
                            *sys.argv[1:]])
        summary = summarize(soak, args, {"command": command, "startup_s": round(startup_s, 1),
                                         "settings": args.settings, "model_path": model_path}, launcher, left)
        summary["left_out"] = soak.left_out
    finally:
        if summary is None:
            launcher.stop()
            print(f"soak: aborted; logs in {root}", file=sys.stderr)
    print_summary(summary)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary written to {args.out}")
    if summary["passed"] and not args.keep and not args.work_dir:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"logs kept in {root}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
