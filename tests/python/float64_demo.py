"""DeMo in float64, written from the paper (not from flexdemo's code): a tensor viewed as 2-D
([n] as 1 x n, [d0, d1, ...] as [d0, rest]), cut into h x w chunks (per dimension the largest
divisor <= the target chunk, as the reference DeMo does), each chunk transformed by the
orthonormal DCT-II built from its cosine formula."""

import math

import torch


def divisor_chunk(n, target):
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def dct_matrix(n):
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    b = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    b[0] /= math.sqrt(2.0)
    return b


def as_2d(shape):
    return (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))


class Reference:
    """One tensor's chunk grid: chunks h x w, coefficients in chunk-major blocks [C, h*w]."""

    def __init__(self, shape, chunk, topk):
        self.topk_ = topk
        self.rows, self.cols = as_2d(shape)
        self.h = 1 if len(shape) == 1 else divisor_chunk(self.rows, chunk)
        self.w = divisor_chunk(self.cols, chunk)
        self.bh, self.bw = dct_matrix(self.h), dct_matrix(self.w)

    def chunks(self, x):  # [rows, cols] -> [C, h, w]
        r, c = self.rows // self.h, self.cols // self.w
        return x.reshape(r, self.h, c, self.w).permute(0, 2, 1, 3).reshape(r * c, self.h, self.w)

    def unchunk(self, y):
        r, c = self.rows // self.h, self.cols // self.w
        return y.reshape(r, c, self.h, self.w).permute(0, 2, 1, 3).reshape(self.rows, self.cols)

    def dct(self, x):  # [rows, cols] -> [C, h*w]
        y = self.bh @ self.chunks(x.double().reshape(self.rows, self.cols)) @ self.bw.T
        return y.reshape(y.shape[0], -1)

    def idct(self, coeffs):  # [C, h*w] -> [rows, cols]
        y = coeffs.reshape(-1, self.h, self.w)
        return self.unchunk(self.bh.T @ y @ self.bw)

    def topk(self, coeffs):  # indices [C, k] of the largest |coefficient| per chunk
        k = min(self.topk_, self.h * self.w)
        return coeffs.abs().topk(k, dim=1).indices.sort(dim=1).values

    def dct_block(self, block):  # flexdemo's block layout [rows, cols] -> [C, h*w]
        return self.chunks(block.reshape(self.rows, self.cols)).reshape(-1, self.h * self.w)
