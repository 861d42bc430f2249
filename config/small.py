# GPT-2 small's shape on the Shakespeare data, 64k tokens per step at any world size (grad_accum splits over ranks)
#   torchrun --standalone --nproc_per_node=4 train.py config/small.py
out_dir = "out-small"
d_model, d_ff, num_layers, num_heads = 768, 3072, 12, 12
context_length = 1024
batch_size = 16
grad_accum = 4
max_iters = 300
warmup_iters = 30
learning_rate = 6e-4
min_lr = 6e-5
eval_interval = 50
eval_iters = 20
save_interval = 1000
compile = True
muon_lr = 0.05  # with --optimizer=muon: 0.01, 0.02 and 0.05 tried here, 0.05 first to the loss
