# The "xl" preset on the Shakespeare data, GPU: ZeRO-1 and per-block activation checkpointing make it fit
#   torchrun --standalone --nproc_per_node=4 train.py config/xl.py        (--ddp_impl=fsdp shards everything instead)
out_dir = "out-xl"
d_model, d_ff, num_layers, num_heads = 2560, 10240, 32, 32
context_length = 1024
batch_size = 4
grad_accum = 8
act_ckpt_every = 1
zero1 = True
max_iters = 200
warmup_iters = 20
learning_rate = 1.5e-4
min_lr = 1.5e-5
eval_interval = 50
log_interval = 5
save_interval = 1000
compile = True
