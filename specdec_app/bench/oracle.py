"""`specdec bench --oracle`: for each adaptive system and row, every fixed K from 1 to K run beside
it, and the adaptive figure's ratio to the best of plain and those.
"""
from __future__ import annotations

from specdec.config import NGRAM
from specdec_app.bench.engine_runner import EngineSystem
from specdec_app.bench.results import SYSTEMS, pool_runs


def oracle_row(built: dict, systems: list[str], results: list, set_name: str, mode, batch: int,
                prompts: list[list[int]], max_new: int, k: int, repeats: int, seed: int, target: str, draft: str,
                kv_blocks: int, max_batch: int) -> list[dict]:
    """--oracle: for each adaptive system of this row, every fixed K from 1 to k (its fixed twin,
    built if it was not asked for), and the best of plain and those beside the adaptive figure."""
    def row_result(key: str):
        return next(r for r in reversed(results) if r.system == key and r.batch == batch and r.mode == mode.name
                    and r.prompt_set == set_name)

    out = []
    for key in [s for s in systems if SYSTEMS[s].adaptive]:
        fixed_key = f"{key}-fixed"
        if fixed_key not in built:
            drafter = NGRAM if SYSTEMS[key].drafter == "ngram" else draft
            built[fixed_key] = EngineSystem(fixed_key, target, drafter, k, kv_blocks, max_batch, adaptive=False)
        rates = {}
        for kk in range(1, k + 1):
            runs = []
            for _ in range(repeats):
                built[fixed_key].warm_up(prompts, batch, mode, seed, k=kk)
                runs.append(built[fixed_key].run(prompts, batch, mode, max_new, seed, k=kk, prompt_set=set_name))
            rates[f"K={kk}"] = pool_runs(runs).tokens_per_s
        plain = row_result("engine").tokens_per_s if "engine" in systems else None
        if plain:
            rates["plain"] = plain
        best = max(rates, key=rates.get)
        adaptive = row_result(key).tokens_per_s
        out.append({"system": key, "prompt_set": set_name, "batch": batch, "mode": mode.name, "adaptive": adaptive,
                    "fixed": {n: v for n, v in rates.items() if n != "plain"}, "plain": plain, "best": best,
                    "best_tokens_per_s": rates[best], "adaptive_vs_best": adaptive / rates[best]})
    return out


def format_oracle(rows: list[dict]) -> str:
    lines = ["the adaptive policy against the best of plain and every fixed K, measured in this run (--oracle):"]
    for r in rows:
        lines.append(f"  {r['prompt_set']:6s} b{r['batch']} {r['mode']:6s} {r['system']:11s} adaptive "
                     f"{r['adaptive']:7.1f} tok/s, best {r['best']:6s} {r['best_tokens_per_s']:7.1f} tok/s -> "
                     f"{r['adaptive_vs_best']:.2f}x")
    worst = min(rows, key=lambda r: r["adaptive_vs_best"])
    lines.append(f"  worst: {worst['adaptive_vs_best']:.2f}x ({worst['prompt_set']} b{worst['batch']} {worst['mode']} "
                 f"{worst['system']})")
    return "\n".join(lines)
