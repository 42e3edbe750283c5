"""Baselines for the CUDA harness's W1/W2/W3 (docs/results.md#workloads), timed the
same way as tests/cuda/harness.cu: CUDA events around one call, an L2 flush
(a 256 MiB read) outside the timed region, warm-up, median (and min) of 200 runs."""
import torch


def bench(fn, iters=200, warmup=10):
    # L2 flush by reading 256 MiB (leaves clean lines: no write-back inside the timed call)
    flush = torch.ones(32 << 20, dtype=torch.int64, device="cuda")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(iters + warmup):
        flush.sum()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if i >= warmup:
            ts.append(e0.elapsed_time(e1) * 1000.0)
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    rows = []
    # W1: topk + gather
    tok = torch.randn(8, 4096, 1024, device=dev, dtype=torch.float16)
    sc = torch.rand(8, 4096, device=dev)

    def w1():
        idx = sc.topk(2048, dim=1).indices
        return torch.gather(tok, 1, idx.unsqueeze(-1).expand(-1, -1, 1024))

    rows.append(("W1 topk+gather", *bench(w1)))
    # W2: keep 4 sinks + top 4092 of the rest, sorted, gather K and V
    K = torch.randn(1, 32, 8192, 128, device=dev, dtype=torch.float16)
    V = torch.randn_like(K)
    s2 = torch.rand(1, 32, 8192, device=dev)
    sinks = torch.arange(4, device=dev).expand(1, 32, 4)

    def w2():
        idx = s2[..., 4:].topk(4092, dim=-1).indices + 4
        idx = torch.cat([sinks, idx], dim=-1).sort(dim=-1).values
        g = idx.unsqueeze(-1).expand(-1, -1, -1, 128)
        return torch.gather(K, 2, g), torch.gather(V, 2, g)

    rows.append(("W2 topk+sort+gather K,V", *bench(w2)))
    # W3: topk + gather
    t3 = torch.randn(32, 1024, 7168, device=dev, dtype=torch.bfloat16)
    s3 = torch.rand(32, 1024, device=dev)

    def w3():
        idx = s3.topk(512, dim=1).indices
        return torch.gather(t3, 1, idx.unsqueeze(-1).expand(-1, -1, 7168))

    rows.append(("W3 topk+gather", *bench(w3)))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"{'baseline':<30} {'median us':>10} {'min us':>10}")
    for name, med, mn in rows:
        print(f"{name:<30} {med:10.2f} {mn:10.2f}")


if __name__ == "__main__":
    main()
