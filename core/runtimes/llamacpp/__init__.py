"""The llama.cpp runtime: the real llama.cpp through llama-cpp-python (``live``), generating token by
token (``engine``), what it allocated read back from it (``observe``), and ``runtime``, the seam, which
runs it in a child process."""
