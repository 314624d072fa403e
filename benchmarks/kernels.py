"""Kernels a decoding step of the engine launches per decoder layer, eager against compiled (issue 34: the fixed
per-step cost). A GPU replays them from a CUDA graph at ~2-3 us each whatever their size, so at the Qwen3-0.6B shape
the step's fixed cost is kernels x layers x ~2.5 us; the target is <= 15 a layer.

    python benchmarks/kernels.py                 # Qwen3-0.6B's layer shape (vocabulary cut: the layer is what counts)
    python benchmarks/kernels.py --flex          # attending through FlexAttention (on the CPU: its C++ template)

eager: the aten operators one layer of Engine.hidden dispatches (TorchDispatchMode; views included, as a GPU runs
none of them but the copies they force). compiled: the kernels in the code inductor writes for Engine.decode_layer
(torch.compile, default mode, static shapes: one compilation serves every layer), counted in its `call`: fused
kernels, extern kernels (matmuls, attention) and aten fallbacks; graph breaks (which would leave eager operators
between compiled pieces) are counted too and must be 0. Counted on the CPU: inductor's CPU and GPU backends fuse the
same nodes (the GPU's extra: none here), so the count is the GPU's up to the matmuls' own kernels.
"""
import argparse
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# a kernel launch in inductor's wrapper code: a fused C++ or Triton kernel, an extern kernel, an aten fallback
LAUNCH = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+)")


def small_engine(shape: dict, layers: int, slots: int, max_len: int, flex: bool, compile: bool):
    import torch

    from grouprl import engine
    import shapes

    shape = dict(shape, num_hidden_layers=layers)
    torch.manual_seed(0)
    lm = shapes.random_model(shape, shapes.word_tokenizer(shape["vocab_size"]), torch.float32)
    # q/k/v and gate/up fused, as on a GPU (on the CPU the engine keeps them apart: fuse=False)
    setup = engine.Setup(slots, "cpu", torch.float32, flex=flex, compile=compile, fuse=True)
    return engine.Engine(lm, setup, max_len)


def step_inputs(eng):
    import torch

    # tokens, positions, read length, every slot alive, greedy sampling (temperature 0: no noise; no
    # min-p, no repetition penalty)
    return (torch.arange(eng.slots) % 7 + 3, torch.arange(eng.slots) + eng.max_len // 2, eng.max_len // 2 + eng.slots,
            None, (0.0, 0, 1.0, 0.0, 1.0))


def eager_ops_per_layer(eng) -> float:
    """aten operators one decoding step dispatches inside its layers, a layer: (all, views left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            Count.views += func.is_view
            return func(*args, **(kwargs or {}))

    layer = eng.decode_layer

    def counted(*a, **k):
        with Count():
            return layer(*a, **k)

    eng.decode_layer = counted
    eng.step(*step_inputs(eng))
    eng.decode_layer = layer
    return Count.n / len(eng.w.layers), (Count.n - Count.views) / len(eng.w.layers)


def compiled_kernels_per_layer(eng) -> dict:
    """The compiled layer's kernels: {"kernels": launches in inductor's code for one layer, "graphs": graphs
    compiled for it, "graph_breaks": dynamo's count, "names": the launches}."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    counters.clear()
    _, codes = run_and_get_code(eng.step, *step_inputs(eng))
    names = []
    for code in codes:
        body = code[code.index("def call("):]
        names += [m.group(1).rstrip("(") for line in body.splitlines() if (m := LAUNCH.match(line))]
    return {"kernels": len(names), "graphs": len(codes), "graph_breaks": sum(counters["graph_break"].values()),
            "names": names}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6B", help="a key of shapes.QWEN3, or 'tiny'")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers built (the count is per layer)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--flex", action="store_true", help="FlexAttention (default: SDPA, the CPU's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    import torch

    import shapes

    torch.set_num_threads(a.threads)
    shape = dict(shapes.TINY if a.shape == "tiny" else shapes.QWEN3[a.shape], vocab_size=1024)
    eng = small_engine(shape, a.layers, a.slots, a.max_len, a.flex, compile=False)
    eager = eager_ops_per_layer(eng) if not a.flex else None  # (flex is a higher-order op: not dispatched)
    eng = small_engine(shape, a.layers, a.slots, a.max_len, a.flex, compile=True)
    t = time.perf_counter()
    c = compiled_kernels_per_layer(eng)
    took = time.perf_counter() - t
    print(f"{a.shape} layer shape, {a.slots} slots, {'flex' if a.flex else 'SDPA'}, torch {torch.__version__}")
    if eager:
        print(f"eager: {eager[0]:.1f} aten operators a layer ({eager[1]:.1f} without the views)")
    print(f"compiled: {c['kernels']} kernels a layer ({c['graphs']} graph(s), {c['graph_breaks']} graph breaks; "
          f"compiled in {took:.0f} s)")
    for name in c["names"]:
        print(f"  {name}")
    print(" ".join(["\ncommand: python", f"benchmarks/{os.path.basename(__file__)}"] + sys.argv[1:]))


if __name__ == "__main__":
    main()
