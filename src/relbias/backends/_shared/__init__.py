"""Helpers shared by several backends: the fused CPU flash kernel's wrappers, the tiled kernel and its band
interior, bias tiles, the autograd helpers, the reasons a backend gives, denormal flushing."""
