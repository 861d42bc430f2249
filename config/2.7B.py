# The older name of the "xl" shape: config/xl.py with its own out_dir
#   torchrun --standalone --nproc_per_node=4 train.py config/2.7B.py
exec(open(__file__.replace("2.7B.py", "xl.py")).read())
out_dir = "out-2.7B"
