# Included by CMake when llama.cpp's project() runs inside llama-cpp-python's build
# (ops/setup.sh passes -DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file>), after llama-cpp-python's
# CMakeLists forced LLAMA_BUILD_COMMON ON and before llama.cpp reads it. llama-cpp-python's
# Python bindings load libllama and libggml only; llama.cpp's `common` library (argument parsing,
# chat parsers, the downloader and its vendored HTTP library) is used by llama.cpp's own programs,
# which this build leaves out. Not building it is most of the compile (docs/results.md).
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp common library: not used by the Python bindings" FORCE)
