"""Linear layers ``y = x @ W^T`` with W in ``nn.Linear`` layout: a tuned small-M (decode) kernel whose untuned
default is cuBLAS."""
