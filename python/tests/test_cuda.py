"""The package on a GPU: torch CUDA tensors bound to the CUDA backend give the CPU backend's rows,
bit for bit, fetch the bytes attention needs, and the step replays inside a CUDA graph. Skipped
without torch, a CUDA device or libess's CUDA backend."""
import numpy as np
import pytest

import ess
from mock_engine import ENTRY, World

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ess.cuda_built() and ess.cuda_device_count() > 0),
                                reason="needs torch with CUDA, libess's CUDA backend and a device")

LAYERS, K, CTX, POOL, T, SLOTS = 2, 64, 1024, 6, 2, 160


def engines():
    host = [np.zeros((POOL * (SLOTS + T), ENTRY), np.uint8) for _ in range(LAYERS)]
    dev = [torch.zeros((POOL * (SLOTS + T), ENTRY), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    common = dict(layers=LAYERS, max_requests=POOL, max_context=CTX, topk=K, query_tokens=T, slots=SLOTS,
                  reserve_newest=True, warmup_windows=4)
    return (ess.Engine(**common, latent=host), host), (ess.Engine(**common, backend="cuda", latent=dev), dev)


def test_device_bytes_are_what_cuda_lost():
    """Engine.device_bytes(): the device memory the engine holds (the caller's layer buffers not counted), as the
    device's free memory sees it (cudaMalloc rounds each allocation up: within 2 MiB per allocation)."""
    dev = [torch.zeros((POOL * (SLOTS + T), ENTRY), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    e = ess.Engine(layers=LAYERS, max_requests=POOL, max_context=CTX, topk=K, query_tokens=T, slots=SLOTS,
                   reserve_newest=True, backend="cuda", latent=dev)
    held = e.device_bytes()
    taken = before - torch.cuda.mem_get_info()[0]
    assert 0 < held <= taken + 2**20, (held, taken)
    e.close()


def test_ordered_lifecycle_matches_the_cpu_backend():
    """The CUDA engine with its lifecycle calls on torch's current stream (Engine.set_lifecycle_stream: admit,
    warmup, extend and release enqueued, not waited for) gives the CPU backend's rows and bytes step by step,
    through a release and a new request in the same row."""
    (cpu, host), (gpu, dev) = engines()
    stream = torch.cuda.current_stream()
    gpu.set_lifecycle_stream(stream)
    world = World(seed=7, layers=LAYERS, topk=K, query_tokens=T, max_context=CTX)
    B = 2
    rows_h, lens_h = np.empty(B, np.int32), np.empty(B, np.int32)
    topk_h, phys_h = np.zeros((B, T, K), np.int32), np.zeros((B, T, K), np.int32)
    rows_d = torch.zeros(B, dtype=torch.int32, device="cuda")
    lens_d = torch.zeros(B, dtype=torch.int32, device="cuda")
    topk_d = torch.zeros((B, T, K), dtype=torch.int32, device="cuda")
    phys_d = torch.zeros_like(topk_d)
    s_cpu = cpu.bind_step(rows_h, topk_h, lens_h, phys_h)
    s_gpu = gpu.bind_step(rows_d, topk_d, lens_d, phys_d)
    live = {}   # batch position -> request

    def admit(b, request, n, row=-1):
        entries = world.new_request(request, n)
        windows = world.warmup_topk(request, 4)
        for e in (cpu, gpu):
            rows_h[b] = e.admit(request, n, row=row)
            for layer in range(LAYERS):
                e.write_entries(request, layer, 0, entries[layer])
            e.warmup(request, windows)
        live[b] = request

    def steps(count, label):
        for step in range(count):
            for b, request in live.items():
                for e in (cpu, gpu):
                    e.extend(request, T)
                world.length[request] += T
                lens_h[b] = world.length[request]
                topk_h[b] = world.query_rows(request)
            rows_d.copy_(torch.from_numpy(rows_h))
            lens_d.copy_(torch.from_numpy(lens_h))
            topk_d.copy_(torch.from_numpy(topk_h))
            for layer in range(LAYERS):
                for b, request in live.items():   # the model's KV write of the new tokens
                    for t in range(T):
                        entry = world.full[request][layer][world.length[request] - T + t]
                        r = cpu.info.reserved_row(int(rows_h[b]), t)
                        host[layer][r] = entry
                        dev[layer][r] = torch.from_numpy(entry).cuda()
                s_cpu.step(layer)
                s_gpu.step(layer, stream=stream)
                torch.cuda.synchronize()
                np.testing.assert_array_equal(phys_d.cpu().numpy(), phys_h, err_msg=f"{label} step {step} layer {layer}")
                valid = phys_h >= 0
                got = dev[layer][torch.from_numpy(phys_h[valid]).long().cuda()].cpu().numpy()
                np.testing.assert_array_equal(got, host[layer][phys_h[valid]], err_msg=f"{label} step {step}")

    admit(0, 10, 300)
    admit(1, 11, 700)
    steps(3, "first requests")
    row = int(rows_h[0])
    for e in (cpu, gpu):
        e.release(10)
    admit(0, 12, 500, row=row)   # the released request's row, at once
    steps(3, "after the release")


def test_step_replays_in_a_cuda_graph():
    (cpu, host), (gpu, dev) = engines()
    world = World(seed=9, layers=LAYERS, topk=K, query_tokens=T, max_context=CTX)
    B = 2
    rows_h = np.empty(B, np.int32)
    for b, n in enumerate([400, 600]):
        entries = world.new_request(b, n)
        for e in (cpu, gpu):
            rows_h[b] = e.admit(b, n)
            for layer in range(LAYERS):
                e.write_entries(b, layer, 0, entries[layer])
    rows_d = torch.from_numpy(rows_h).cuda()
    lens_h = np.array([400, 600], np.int32)
    lens_d = torch.from_numpy(lens_h).cuda()
    topk_h, phys_h = np.zeros((B, T, K), np.int32), np.zeros((B, T, K), np.int32)
    topk_d = torch.zeros((B, T, K), dtype=torch.int32, device="cuda")
    phys_d = torch.zeros_like(topk_d)
    s_cpu = cpu.bind_step(rows_h, topk_h, lens_h, phys_h)
    s_gpu = gpu.bind_step(rows_d, topk_d, lens_d, phys_d)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            s_gpu.step(0, stream=stream)
    for step in range(4):
        for b in range(B):
            world.length[b] = int(lens_h[b])
            topk_h[b] = world.query_rows(b)[:, :K]
        topk_d.copy_(torch.from_numpy(topk_h))
        s_cpu.step(0)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(phys_d.cpu().numpy(), phys_h, err_msg=f"replay {step}")


def test_a_followers_step_on_a_side_stream_beside_the_next_leaders():
    """The SGLang adapter's shared-index prefetch (ess/integrations/sglang/shared_index.py) as the CUDA engine sees it:
    layer 1 shares layer 0's top-k; its step runs on a side stream with the engine's scratch set 1, forked after layer
    0's step, while layer 2's step runs on the main stream with set 0, unordered with it; each layer's rows and bytes
    are the CPU backend's (steps run one after another there)."""
    layers = 3
    host = [np.zeros((POOL * (SLOTS + T), ENTRY), np.uint8) for _ in range(layers)]
    dev = [torch.zeros((POOL * (SLOTS + T), ENTRY), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    common = dict(layers=layers, max_requests=POOL, max_context=CTX, topk=K, query_tokens=T, slots=SLOTS,
                  reserve_newest=True, warmup_windows=4)
    cpu, gpu = ess.Engine(**common, latent=host), ess.Engine(**common, backend="cuda", latent=dev)
    world = World(seed=11, layers=layers, topk=K, query_tokens=T, max_context=CTX)
    B = 3
    rows_h = np.empty(B, np.int32)
    for b, n in enumerate([300, 500, 800]):
        entries = world.new_request(b, n)
        for e in (cpu, gpu):
            rows_h[b] = e.admit(b, n)
            for layer in range(layers):
                e.write_entries(b, layer, 0, entries[layer])
    lens_h = np.array([300, 500, 800], np.int32)
    rows_d, lens_d = torch.from_numpy(rows_h).cuda(), torch.from_numpy(lens_h).cuda()
    topk_h = [np.zeros((B, T, K), np.int32) for _ in range(2)]            # the leaders' (layers 0 and 2)
    phys_h = [np.zeros((B, T, K), np.int32) for _ in range(layers)]
    topk_d = [torch.zeros((B, T, K), dtype=torch.int32, device="cuda") for _ in range(2)]
    phys_d = [torch.zeros((B, T, K), dtype=torch.int32, device="cuda") for _ in range(layers)]
    uses = [0, 0, 1]   # each layer's top-k: layer 1 its leader's
    s_cpu = [cpu.bind_step(rows_h, topk_h[uses[l]], lens_h, phys_h[l]) for l in range(layers)]
    s_gpu = [gpu.bind_step(rows_d, topk_d[uses[l]], lens_d, phys_d[l]) for l in range(layers)]
    main, side, done = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Event()
    for step in range(4):
        for b in range(B):
            for e in (cpu, gpu):
                e.extend(b, T)
            world.length[b] += T
            lens_h[b] = world.length[b]
            topk_h[0][b] = world.query_rows(b)
            topk_h[1][b] = world.query_rows(b)
        lens_d.copy_(torch.from_numpy(lens_h))
        for i in range(2):
            topk_d[i].copy_(torch.from_numpy(topk_h[i]))
        for layer in range(layers):   # the model's KV write of the new tokens
            for b in range(B):
                for t in range(T):
                    entry = world.full[b][layer][world.length[b] - T + t]
                    r = cpu.info.reserved_row(int(rows_h[b]), t)
                    host[layer][r] = entry
                    dev[layer][r] = torch.from_numpy(entry).cuda()
        for layer in range(layers):
            s_cpu[layer].step(layer)
        s_gpu[0].step(0, stream=main)
        side.wait_stream(main)
        s_gpu[1].step_async(1, B, 1, side.cuda_stream)
        done.record(side)
        s_gpu[2].step(2, stream=main)   # beside the side stream's step
        main.wait_event(done)
        torch.cuda.synchronize()
        for layer in range(layers):
            np.testing.assert_array_equal(phys_d[layer].cpu().numpy(), phys_h[layer], err_msg=f"step {step} {layer}")
            valid = phys_h[layer] >= 0
            got = dev[layer][torch.from_numpy(phys_h[layer][valid]).long().cuda()].cpu().numpy()
            np.testing.assert_array_equal(got, host[layer][phys_h[layer][valid]], err_msg=f"step {step} {layer}")
