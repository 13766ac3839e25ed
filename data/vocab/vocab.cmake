# The DeepSeek V4 vocabulary GGUF (tokens, merges, token types; no tensors), written by dsv4-vocab from DeepSeek
# V3's tokenizer.json with V4's added-token table, committed compressed and extracted at configure time.
#
# Sets DSV4_VOCAB_GGUF (cache, so every directory configured after the first include sees it) to
# ${CMAKE_BINARY_DIR}/share/dsv4/deepseek-v4-vocab.gguf. Re-extracts when the archive changes.
include_guard(GLOBAL)

set(_dsv4_vocab_archive ${CMAKE_CURRENT_LIST_DIR}/deepseek-v4-vocab.gguf.tar.xz)
set(_dsv4_vocab_dir ${CMAKE_BINARY_DIR}/share/dsv4)
set(DSV4_VOCAB_GGUF ${_dsv4_vocab_dir}/deepseek-v4-vocab.gguf
    CACHE INTERNAL "DeepSeek V4 vocabulary-only GGUF (extracted from data/vocab)")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_dsv4_vocab_archive})

file(SHA256 ${_dsv4_vocab_archive} _dsv4_vocab_hash)
if(NOT EXISTS ${DSV4_VOCAB_GGUF} OR NOT _dsv4_vocab_hash STREQUAL "${DSV4_VOCAB_ARCHIVE_SHA256}")
  file(REMOVE ${DSV4_VOCAB_GGUF})
  file(ARCHIVE_EXTRACT INPUT ${_dsv4_vocab_archive} DESTINATION ${_dsv4_vocab_dir})
  if(NOT EXISTS ${DSV4_VOCAB_GGUF})
    message(FATAL_ERROR "${_dsv4_vocab_archive} does not hold deepseek-v4-vocab.gguf")
  endif()
  set(DSV4_VOCAB_ARCHIVE_SHA256 ${_dsv4_vocab_hash} CACHE INTERNAL "archive the extracted vocabulary came from")
endif()
