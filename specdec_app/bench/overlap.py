"""`specdec bench --overlap`: plain decoding, serial speculation and overlapped speculation side by
side, with the draft and the target as separate worker processes (one torch thread each, gRPC on
loopback), as on two devices.

Overlap only pays when the two workers have their own compute; in one process they share the
interpreter and the cores. All three systems drive the same two worker processes, one after the
other, on the same prompts, so their ratios compare like with like. Per row: tokens/s, the ratio
to serial, the fraction of pre-drafted tokens kept, worker messages and wire bytes per committed
token; `--timeline` adds where one round's time went (draft busy, target busy, waiting).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import time
from dataclasses import dataclass, field

import torch

from coordinator.rounds.grpc_clients import GrpcDraftClient, GrpcTargetClient
from coordinator.rounds.request import Request
from coordinator.rounds.scheduler import Scheduler
from draft_worker import grpc_server as draft_server
from draft_worker.worker import DraftWorker
from specdec.config import ServiceConfig
from specdec.params import SamplingParams
from target_worker import grpc_server as target_server
from target_worker.worker import TargetWorker

OVERLAP_SYSTEMS = ("plain", "serial", "overlapped")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("overlapped drafting (workers in their own processes)")
    group.add_argument("--overlap", action="store_true",
                       help="also compare plain, serial and overlapped speculation with the draft and the target "
                            "in separate worker processes (gRPC on loopback)")
    group.add_argument("--overlap-only", action="store_true", help="only that comparison (skip the main grid)")
    group.add_argument("--overlap-repeats", type=int, default=3, help="runs per row; the median is shown (default 3)")
    group.add_argument("--worker-threads", type=int, default=1, help="torch threads of each worker process (default 1)")
    group.add_argument("--timeline", action="store_true", help="print the mean timeline of one round per row")


def _serve_worker(role: str, config, threads: int, ports) -> None:
    """A worker process: build the worker, serve it on a free loopback port, report the port."""
    torch.set_num_threads(threads)
    if role == "target":
        server, port = target_server.serve(TargetWorker.from_config(config.target))
    else:
        server, port = draft_server.serve(DraftWorker.from_config(config.draft))
    ports.put(port)
    server.wait_for_termination()


class WorkerProcesses:
    """The target and draft workers, each in its own process; stopped on exit."""

    def __init__(self, config, threads: int):
        context = multiprocessing.get_context("spawn")  # no torch state inherited from this process
        self.processes, self.addresses = [], {}
        for role in ("target", "draft"):
            ports = context.Queue()
            process = context.Process(target=_serve_worker, args=(role, config, threads, ports), daemon=True)
            process.start()
            self.processes.append(process)
            self.addresses[role] = f"127.0.0.1:{ports.get(timeout=300)}"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.terminate()
            process.join(10)


@dataclass
class OverlapRun:
    system: str
    prompt_set: str
    mode: str
    batch: int
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    messages: int = 0
    wire_bytes: int = 0
    predraft_tokens: int = 0
    predraft_kept: int = 0
    hits: int = 0
    misses: int = 0
    phases: dict = field(default_factory=dict)  # summed seconds: draft, verify, predraft, wait, total
    outputs: list = field(default_factory=list)  # each prompt's generated tokens, in prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _drive(scheduler, prompts, params, prefix: str, run: OverlapRun, wires) -> None:
    """Run the prompts to the end on this scheduler, `batch` at a time, tallying the reports."""
    before = sum(w.bytes_sent + w.bytes_received for w in wires)
    for start in range(0, len(prompts), run.batch):
        ids = [f"{prefix}-{start + i}" for i in range(len(prompts[start:start + run.batch]))]
        for req_id, prompt in zip(ids, prompts[start:start + run.batch]):
            scheduler.add_request(Request(req_id=req_id, prompt_ids=list(prompt), params=params))
        left = set(ids)
        generated = {req_id: [] for req_id in ids}
        while left:
            report = scheduler.step()
            run.tokens += report.committed_tokens
            run.messages += report.worker_calls
            run.predraft_tokens += report.predraft_tokens
            run.predraft_kept += report.predraft_kept
            run.hits += report.predraft_hits
            run.misses += report.predraft_misses
            if report.ran:
                run.rounds += 1
                for name, value in [("draft", report.draft_seconds), ("verify", report.verify_seconds),
                                    ("predraft", report.predraft_seconds), ("wait", report.predraft_wait_seconds),
                                    ("total", report.total_seconds)]:
                    run.phases[name] = run.phases.get(name, 0.0) + value
            for update in report.updates:
                if update.req_id in generated:
                    generated[update.req_id] += update.token_ids
                if update.finished:
                    if update.error:
                        raise RuntimeError(f"bench request {update.req_id} failed: {update.error}")
                    left.discard(update.req_id)
        run.outputs += [generated[req_id] for req_id in ids]
    while scheduler.has_work():  # deliver the releases
        scheduler.step()
    run.wire_bytes = sum(w.bytes_sent + w.bytes_received for w in wires) - before


def run_overlap(target: str, draft: str, prompt_sets: dict, modes, batch_sizes, k: int, max_new: int,
                kv_blocks: int, threads: int, repeats: int, log) -> list[OverlapRun]:
    """Every (prompt set, mode, batch, system) row: the median run of `repeats` by tokens/s."""
    config = ServiceConfig.from_settings(target=target, draft=draft, num_speculative_tokens=k,
                                         kv_cache_blocks=kv_blocks, max_batch_size=max(batch_sizes))
    rows: list[OverlapRun] = []
    with WorkerProcesses(config, threads) as workers:
        target_client = GrpcTargetClient(workers.addresses["target"])
        draft_client = GrpcDraftClient(workers.addresses["draft"])
        try:
            target_client.wait_ready(), draft_client.wait_ready()
            log(f"overlap bench: workers in processes at {workers.addresses} ({threads} torch thread(s) each)")
            schedulers = {
                "plain": Scheduler(target_client, None, None,
                                   dataclasses.replace(config.scheduler, num_speculative_tokens=0)),
                "serial": Scheduler(target_client, draft_client, None,
                                    dataclasses.replace(config.scheduler, overlap=False)),
                "overlapped": Scheduler(target_client, draft_client, None,
                                        dataclasses.replace(config.scheduler, overlap=True)),
            }
            counter = 0
            for set_name, prompts in prompt_sets.items():
                for mode in modes:
                    params = SamplingParams(max_new_tokens=max_new, temperature=mode.temperature, ignore_eos=True)
                    for batch in batch_sizes:
                        runs = {name: [] for name in OVERLAP_SYSTEMS}
                        for name, scheduler in schedulers.items():  # warm up
                            counter += 1
                            _drive(scheduler, prompts[:batch], dataclasses.replace(params, max_new_tokens=8),
                                   f"warm{counter}", OverlapRun(name, set_name, mode.name, batch), [])
                        for _ in range(repeats):  # interleaved, so drifting load hits all alike
                            for name, scheduler in schedulers.items():
                                counter += 1
                                run = OverlapRun(name, set_name, mode.name, batch)
                                wires = [target_client.wire] + ([draft_client.wire] if name != "plain" else [])
                                start = time.perf_counter()
                                _drive(scheduler, prompts, params, f"b{counter}", run, wires)
                                run.seconds = time.perf_counter() - start
                                runs[name].append(run)
                        for name in OVERLAP_SYSTEMS:
                            ordered = sorted(runs[name], key=lambda r: r.tokens_per_s)
                            rows.append(ordered[len(ordered) // 2])
                        serial, overlapped = rows[-2], rows[-1]
                        log(f"  {set_name} {mode.name} b{batch}: overlapped/serial "
                            f"{overlapped.tokens_per_s / serial.tokens_per_s:.2f}x")
        finally:
            target_client.close()
            draft_client.close()
    return rows


def format_table(rows: list[OverlapRun], timeline: bool) -> str:
    """One line per row, grouped by (prompt set, mode, batch)."""
    lines = ["| prompts | mode | batch | system | tok/s | vs serial | vs plain | pre-drafted kept | "
             "messages/token | bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for row in rows:
        groups.setdefault((row.prompt_set, row.mode, row.batch), {})[row.system] = row
    for (set_name, mode, batch), by_system in groups.items():
        serial, plain = by_system.get("serial"), by_system.get("plain")
        for name in OVERLAP_SYSTEMS:
            row = by_system.get(name)
            if row is None:
                continue
            kept = f"{row.predraft_kept / row.predraft_tokens:.0%}" if row.predraft_tokens else "-"
            lines.append(f"| {set_name} | {mode} | {batch} | {name} | {row.tokens_per_s:.1f} | "
                         f"{row.tokens_per_s / serial.tokens_per_s:.2f}x | {row.tokens_per_s / plain.tokens_per_s:.2f}x"
                         f" | {kept} | {row.messages / row.tokens:.3f} | {row.wire_bytes / row.tokens:.0f} |")
    if timeline:
        lines += ["", "Mean round timeline (ms): draft = serial draft call (target idle), verify = target call "
                      "(pre-draft running beside it), pre-draft = the draft's concurrent call, wait = step blocked "
                      "on the pre-draft after the verify, other = coordinator + messaging outside these",
                  "| prompts | mode | batch | system | rounds | draft | verify | pre-draft | wait | other | total | "
                  "hit rate |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            n = max(row.rounds, 1)
            ph = {name: 1000 * row.phases.get(name, 0.0) / n for name in ("draft", "verify", "predraft", "wait",
                                                                         "total")}
            other = ph["total"] - ph["draft"] - ph["verify"] - ph["wait"]
            verdicts = row.hits + row.misses
            hit = f"{row.hits / verdicts:.0%}" if verdicts else "-"
            lines.append(f"| {row.prompt_set} | {row.mode} | {row.batch} | {row.system} | {row.rounds} | "
                         f"{ph['draft']:.1f} | {ph['verify']:.1f} | {ph['predraft']:.1f} | {ph['wait']:.1f} | "
                         f"{other:.1f} | {ph['total']:.1f} | {hit} |")
    return "\n".join(lines)



def run_section(args, target: str, draft: str, prompt_sets: dict, modes, batch_sizes, k: int, max_new: int,
                kv_blocks: int, log) -> tuple[list[OverlapRun], str]:
    """The comparison `specdec bench --overlap` prints: (rows, text)."""
    rows = run_overlap(target, draft, {name: ids for name, (ids, _) in prompt_sets.items()}, modes, batch_sizes,
                       k, max_new, kv_blocks, args.worker_threads, max(1, args.overlap_repeats), log)
    text = (f"Overlapped drafting: draft and target in separate processes ({args.worker_threads} torch thread(s) "
            f"each, gRPC on loopback), K={k} adaptive, median of {max(1, args.overlap_repeats)} runs per row\n"
            "  pre-drafted kept = pre-drafted tokens used (confirmed guesses + proposals) / pre-drafted tokens; "
            "messages/token = worker messages (request + reply) per committed token; bytes/token = payload bytes "
            "both ways\n" + format_table(rows, args.timeline))
    return rows, text
