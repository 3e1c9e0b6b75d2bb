"""Real llama-server state files a turn apart, for ``python -m e2e.turncost --files``.

    python3 benchmarks/turn_states.py --kv q4 --tokens 2700 --turns 100,200,300 --out DIR
    python3 benchmarks/turn_states.py --kv f16 --tokens 9500 --turns 200,200 --out DIR
    python3 benchmarks/turn_states.py --kv f16 --flash-attn off --tokens 2700 --out DIR

One llama-server (the e2e harness's build and random-weight ``llama12`` model, one slot,
``--cache-ram 0``; ``-ctk/-ctv q4_0`` for ``--kv q4``) prefills a conversation of random prompt
tokens (``--tokens``, kept in ``DIR`` and reused), saves it as ``NAME.0``, then for each entry of
``--turns`` adds that many prompt tokens (+4 generated, greedy) and saves ``NAME.1``, ``NAME.2``...
Each ``NAME.i`` -> ``NAME.i+1`` is a next turn.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import real_state as rs  # noqa: E402

from e2e.build import cache_dir, ensure_llama_server, src_tree  # noqa: E402
from e2e.models import ensure_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", choices=("f16", "q4"), default="f16")
    p.add_argument("--model", choices=tuple(rs.MODELS), default="llama12")
    p.add_argument("--tokens", type=int, default=2700)
    p.add_argument("--turns", default="200,200", help="prompt tokens of each next turn")
    p.add_argument("--flash-attn", choices=("on", "off"), default="on")
    p.add_argument("--seed", default="0")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    turns = [int(x) for x in args.turns.split(",") if x]
    binary = ensure_llama_server()
    gguf = ensure_model(args.model, cache_dir(), src_tree()).path
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.kv}-{args.model}-fa{args.flash_attn}-{args.tokens}"
    ctx = args.tokens + sum(turns) + 8 * (len(turns) + 1) + 256
    slot = rs.Slot(binary, gguf, args.out, args.kv, ctx=ctx)
    slot.srv.flash_attn = args.flash_attn
    slot.srv.start()
    try:
        rnd = random.Random(f"{name}-{args.seed}")
        t0 = time.perf_counter()
        slot.new_conversation(args.tokens, rnd)
        print(f"{name}: prefilled {slot.n_cached} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        slot.save_to(args.out / f"{name}.0")
        for i, n in enumerate(turns, 1):
            slot.complete(slot.history + [rnd.randrange(*rs.VOCAB) for _ in range(n)])
            slot.save_to(args.out / f"{name}.{i}")
            print(f"{name}.{i}: {slot.n_cached} tokens", flush=True)
    finally:
        slot.srv.stop()


if __name__ == "__main__":
    main()
