"""A Megatron-Core GPT job on CPU (gloo) monitored by trainmon from a JSON config.

  OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 --master_addr=127.0.0.1 --master_port=29511 \
      scripts/train_megatron.py --tp 2 --config configs/megatron.json
  # --pp 2 (1F1B pipeline), --pp 2 --vpp 2 (interleaved, 2 model chunks per stage),
  # --distopt (DistributedOptimizer over DP), --overlap (async grad reduce / param gather), --bf16 (Float16Module);
  # --fp16 (Float16Module in fp16, dynamic loss scaling: a step with a non-finite grad is skipped);
  # 4 processes: --tp 2 --pp 2.
  # --moe-experts 4 --ep 2: every layer's MLP is 4 experts (SequentialMLP), 2 on each expert-parallel rank.
  # --optimizer torch: torch.optim.AdamW on unwrapped chunks, as Megatron-Core's quick-start trains.
  # --config none trains unmonitored; --timings PATH writes step times (benchmarks/frameworks.py).

Output: $MONITOR_OUTPUT_DIR (default ./monitor_output)/<run>/rank_<R>/.
"""
import argparse
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (needs --pp > 1)")
    parser.add_argument("--distopt", action="store_true", help="DistributedOptimizer (shards over DP)")
    parser.add_argument("--overlap", action="store_true", help="overlapped (asynchronous) grad reduce and, with "
                        "--distopt, param gather")
    parser.add_argument("--moe-experts", type=int, default=0, help="MoE: experts per layer (0: dense MLP)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (splits --moe-experts)")
    parser.add_argument("--dispatcher", choices=["alltoall", "allgather"], default="alltoall",
                        help="MoE token dispatcher (both run on gloo)")
    parser.add_argument("--moe-capacity", type=float, default=None,
                        help="MoE: expert capacity factor (tokens beyond it are dropped; default: no capacity)")
    parser.add_argument("--optimizer", choices=["megatron", "torch"], default="megatron",
                        help="megatron: DDP-wrapped chunks and get_megatron_optimizer; torch: AdamW, no DDP")
    parser.add_argument("--bf16", action="store_true", help="bf16 model (Float16Module), fp32 main params")
    parser.add_argument("--fp16", action="store_true", help="fp16 model (Float16Module), fp32 main params, "
                        "dynamic loss scaling")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing of every layer")
    parser.add_argument("--deallocate-outputs", action="store_true",
                        help="deallocate_pipeline_outputs (as Megatron-LM sets it): a stage's output tensor gets a "
                             "one-element dummy as its .data once sent")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="default: 2 per pipeline chunk")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "megatron.json"),
                        help='trainmon config; "none" trains without a monitor')
    parser.add_argument("--timings", metavar="PATH", help="write step times and module calls to PATH.rank<R>.json")
    return parser.parse_args(argv)


def setup(args):
    """Process groups, the GPT model chunks (DDP-wrapped for Megatron's optimizer) and the optimizer; returns
    (chunks, optimizer)."""
    import cpu_shims
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_shims.apply()
    dist.init_process_group("gloo")
    vpp = args.vpp if args.vpp > 1 else None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=args.ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = TransformerConfig(
        num_layers=args.layers or 2 * args.pp * args.vpp, hidden_size=args.hidden, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=dtype, params_dtype=torch.float32, bf16=args.bf16, fp16=args.fp16,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=vpp, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        # Under VPP on 2 stages a stage's previous and next stage are the same rank; a batched p2p then posts two
        # sends to one peer, which gloo matches to the receives in posting order: activations and grads swap.
        batch_p2p_comm=vpp is None, deallocate_pipeline_outputs=args.deallocate_outputs,
        **(dict(num_moe_experts=args.moe_experts, expert_model_parallel_size=args.ep, moe_router_topk=2,
                moe_ffn_hidden_size=args.hidden, moe_token_dispatcher_type=args.dispatcher,
                moe_grouped_gemm=False, moe_expert_capacity_factor=args.moe_capacity) if args.moe_experts else {}),
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if args.recompute else {}))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=args.distopt,
                                               overlap_grad_reduce=args.overlap,
                                               overlap_param_gather=args.overlap and args.distopt)
    layer_spec = get_gpt_layer_local_spec(num_experts=args.moe_experts or None, moe_grouped_gemm=False)
    chunks = []
    for stage in range(args.vpp):
        stage_kw = {"ignore_virtual": False, "vp_stage": stage} if vpp else {}
        model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=args.vocab,
                         max_sequence_length=args.seq, pre_process=parallel_state.is_pipeline_first_stage(**stage_kw),
                         post_process=parallel_state.is_pipeline_last_stage(**stage_kw),
                         share_embeddings_and_output_weights=args.pp == 1, position_embedding_type="learned_absolute",
                         vp_stage=stage if vpp else None)
        if args.bf16 or args.fp16:
            model = Float16Module(config, model)
        chunks.append(model)
    if args.optimizer == "torch":
        return chunks, torch.optim.AdamW([p for chunk in chunks for p in chunk.parameters()], lr=1e-3,
                                         weight_decay=0.0)
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model) for model in chunks]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=args.bf16, fp16=args.fp16, params_dtype=torch.float32,
        # the default initial scale (2**32) overflows this model's fp16 grads: its first steps would be skipped
        loss_scale=None, initial_loss_scale=2.0 ** 12,
        use_distributed_optimizer=args.distopt, clip_grad=1.0), chunks)
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss  # the schedules then scale the loss before backward
    config.no_sync_func = [c.no_sync for c in chunks] if vpp else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, optimizer


def data_iterators(args, chunks):
    """The schedule's data: one iterator per model chunk, each drawing the same batches. The interleaved
    schedule runs the chunks' micro-batches in its own order; a shared iterator would give a chunk
    another micro-batch than the one its neighbouring chunks (and the labels on the last stage) work on."""
    return [batches(args) for _ in chunks] if len(chunks) > 1 else batches(args)


def batches(args):
    """Learnable synthetic batches (next token = token + 1): the same on every TP/PP rank, per DP rank its own."""
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(1000 + parallel_state.get_data_parallel_rank())
    while True:
        start = torch.randint(0, args.vocab, (args.mbs, 1), generator=gen)
        tokens = (start + torch.arange(args.seq + 1)) % args.vocab
        yield dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                   position_ids=torch.arange(args.seq).unsqueeze(0).expand(args.mbs, -1).contiguous(),
                   attention_mask=torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1),
                   loss_mask=torch.ones(args.mbs, args.seq))


def _loss(loss_mask, output):
    loss = torch.sum(output.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule divides the output in place


def forward_step(data, model):
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def train_step(args, chunks, optimizer, data):
    """One optimizer step over `args.micro_batches` micro-batches; returns (the mean loss on the last stage or
    None, whether the optimizer updated the params: Megatron's skips a step whose grads are not finite under
    fp16 loss scaling)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):  # Megatron's DDP
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data,
        model=chunks, num_microbatches=args.micro_batches,
        seq_length=args.seq, micro_batch_size=args.mbs, decoder_seq_length=args.seq, forward_only=False)
    result = optimizer.step()  # Megatron's: (update applied, grad norm, zeros in grads); torch's: None
    loss = sum(float(d["lm loss"]) for d in losses) / len(losses) if losses else None
    return loss, result is None or bool(result[0])


def main() -> None:
    args = parse_args()
    chunks, optimizer = setup(args)
    from step_timer import StepTimer
    from trainmon import TrainerMon

    monitor = None
    if args.config != "none":
        monitor = TrainerMon(args.config)
        monitor.set_monitor(chunks, optimizer=optimizer, grad_acc_steps=args.micro_batches)
    timer = StepTimer(args.timings, dist.get_rank()) if args.timings else None
    data = data_iterators(args, chunks)
    for step in range(args.steps):
        loss, applied = train_step(args, chunks, optimizer, data)
        if timer:
            timer.step_done()
        if loss is not None:
            print(f"[rank{dist.get_rank()}] step {step} loss {loss:.4f}{'' if applied else ' (skipped)'}", flush=True)
    if timer:
        with timer.count_calls([m for chunk in chunks for m in chunk.modules()]):
            train_step(args, chunks, optimizer, data)
        timer.write()
    if monitor:
        monitor.stop()
        print(f"[rank{dist.get_rank()}] monitor output in {monitor.output_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
