// The flags of the inputs `ess sim` and `ess plan` share (sim::Inputs: model, hardware profile,
// deployment with overrides, miss model, measured op tables).
#pragma once

#include <CLI/CLI.hpp>

#include "commands.h"
#include "ess/sim/inputs.h"

namespace ess::cli {

// The command-line flags of sim::Inputs.
struct SimInputs : sim::Inputs {
  void add_to(CLI::App& cmd) {
    cmd.add_option("--model", model, "Model config.json (default: the shipped DeepSeek-V3.2-Exp)");
    cmd.add_option("--hardware", hardware,
                   "Hardware profile: a shipped name (h100, h200, h20-141gb, h800, paper-table1) or a JSON file")
        ->capture_default_str();
    cmd.add_option("--deployment", deployment,
                   "Deployment: a shipped name (paper-table1, minimax-m3-tp8) or a JSON file (default: paper-table1; "
                   "MiniMax-M3: minimax-m3-tp8)");
    cmd.add_option("--mtp", mtp, "Override: MTP query tokens per request per step (1 = no MTP); without --accept, the accept ratio becomes min(the deployment's, MTP)")
        ->check(in_range(1, 16));
    cmd.add_option("--accept", accept, "Override: MTP accept ratio (tokens kept per step, in [1, T])")
        ->check(in_range(1.0, 16.0));
    cmd.add_option("--nodes", nodes, "Override: nodes")->check(in_range(1, 4096));
    cmd.add_option("--gpus-per-node", gpus_per_node, "Override: GPUs per node")->check(in_range(1, 64));
    cmd.add_option("--ep", ep, "Override: expert-parallel degree")->check(in_range(1, 4096 * 64));
    cmd.add_option("--mem-fraction", mem_fraction, "Override: mem_fraction_static (weights + caches)")
        ->check(above_at_most(0, 1));
    cmd.add_flag("--no-tbo", no_tbo, "Turn Two-Batch Overlap off");
    cmd.add_flag("--no-prefetch", no_prefetch,
                 "A model whose layers share an indexer's top-k (GLM-5.2): each shared layer swaps at its own turn "
                 "instead of its copy issued at its leader's layer");
    cmd.add_option("--rig-layers", rig_layers,
                   "Model the single-GPU executor rig of `ess bench step` with this many MoE layers (no all-to-all, "
                   "TBO, LM head or MTP drafts; needs --batch)")
        ->check(in_range(0, 1024));
    cmd.add_option("--misses", reference_misses,
                   "Parametric miss model: mean misses per request-layer-step at 6554 slots (ratio 0.2 of 32K), "
                   "T = 2 (default 200)")
        ->check(in_range(0, 16.0 * (1 << 20)));
    cmd.add_option("--miss-exponent", miss_exponent, "Parametric miss model: exponent of (6554 / slots) (default 1)")
        ->check(in_range(0.0, 4.0));
    cmd.add_option("--miss-profile", miss_profile,
                   "Miss profile: `ess trace analyze --miss-profile` output (per-layer means at a pool size), or JSON "
                   "with per_layer_misses (e.g. `ess verify --format json`: per-layer shape only)");
    cmd.add_option("--pool-floor", pool_floor,
                   "The smallest pool a request-layer may get: max (the miss profile's max MTP working set x (1 + "
                   "margin); default), p99 (its p99: the rarer larger steps run in query groups, charged) or tk "
                   "(T x top-k); without a miss profile the working set is the built-in locality model's")
        ->check(CLI::IsMember({"max", "p99", "tk"}));
    cmd.add_option("--pool-floor-margin", pool_floor_margin, "Margin on the measured working set (default 0.1)");
    cmd.add_option("--prefix-share", prefix_share,
                   "Fraction of the context every request of a GPU shares (a common prompt prefix): its host "
                   "pages are held once")
        ->check(in_range(0.0, 1.0));
    cmd.add_option("--host-reserve", host_reserve,
                   "Share of host DRAM the host pool leaves to the OS and the serving engine (default: the hardware "
                   "profile's host_dram_reserve, 0.1)")
        ->check(in_range(0.0, 0.9));
    cmd.add_option("--op-table", op_table, "Measured op times: CSV op,context,tokens,time_us (see docs/simulator.md)");
  }
};

}  // namespace ess::cli
