# The "large" preset on the Shakespeare data, GPU
#   torchrun --standalone --nproc_per_node=4 train.py config/large.py
out_dir = "out-large"
d_model, d_ff, num_layers, num_heads = 1280, 5120, 36, 20
context_length = 1024
batch_size = 8
grad_accum = 8
max_iters = 300
warmup_iters = 30
learning_rate = 2.5e-4
min_lr = 2.5e-5
eval_interval = 50
save_interval = 1000
compile = True
