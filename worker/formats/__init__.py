"""Pure formats, no sockets and no threads: ggml block quantization (``quant``) and BLAKE3 content
hashes (``hashing``). Any thread may call them; the worker's backend thread and the client (llama
runtime, file identity) both use them, which is why nothing here imports more than numpy and
:mod:`zmq_rpc.broker.ops`. Imports nothing on import.
"""
