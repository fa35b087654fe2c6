"""The package on a GPU: torch CUDA tensors bound to the CUDA backend give the CPU backend's rows,
bit for bit, fetch the bytes attention needs, and the step replays inside a CUDA graph. Skipped
without torch, a CUDA device or libess's CUDA backend."""
import numpy as np
import pytest

import ess
from ess.integrations.sglang import HiSparseCoordinator
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


def test_sglang_adapter_on_cuda_matches_the_cpu_backend():
    (cpu, host), (gpu, dev) = engines()
    like = torch.empty(0, dtype=torch.int32, device="cuda")
    c_cpu, c_gpu = HiSparseCoordinator(cpu, 4), HiSparseCoordinator(gpu, 4, like=like)
    world = World(seed=5, layers=LAYERS, topk=K, query_tokens=T, max_context=CTX)
    order = [0, 3, 5]
    for idx, n in zip(order, [300, 700, 150]):
        entries = world.new_request(idx, n)
        windows = world.warmup_topk(idx, 6)
        for c in (c_cpu, c_gpu):
            c.admit_request_direct(type("Req", (), {"req_pool_idx": idx, "seqlen": n})(), entries=entries,
                                   warmup_topk=windows)
    for step in range(6):
        for idx in order:
            world.length[idx] += T
        rpi = np.array(order, np.int64)
        lens = np.array([world.length[i] for i in order], np.int64)
        r_cpu = c_cpu.map_last_loc_to_buffer(lens, None, rpi, lens)
        r_gpu = c_gpu.map_last_loc_to_buffer(torch.from_numpy(lens).cuda(), None, torch.from_numpy(rpi).cuda(), lens,
                                             rpi)
        assert np.array_equal(r_cpu, r_gpu.cpu().numpy())
        for b, idx in enumerate(order):
            for t in range(T):
                for layer in range(LAYERS):
                    entry = world.full[idx][layer][world.length[idx] - T + t]
                    host[layer][r_cpu[b, t]] = entry
                    dev[layer][int(r_cpu[b, t])] = torch.from_numpy(entry).cuda()
        for layer in range(LAYERS):
            rows = np.stack([world.query_rows(idx) for idx in order]).reshape(-1, K)
            p_cpu = c_cpu.swap_in_selected_pages(rpi, lens, rows.astype(np.int32), layer).copy()
            p_gpu = c_gpu.swap_in_selected_pages(None, None, torch.from_numpy(rows).cuda(), layer)
            torch.cuda.synchronize()
            np.testing.assert_array_equal(p_gpu.cpu().numpy(), p_cpu, err_msg=f"step {step} layer {layer}")
            valid = p_cpu >= 0
            got = dev[layer][torch.from_numpy(p_cpu[valid]).long().cuda()].cpu().numpy()
            want = host[layer][p_cpu[valid]]
            np.testing.assert_array_equal(got, want)


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
