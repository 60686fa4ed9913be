// AMX tile basics shared by the attention tiles (micro_gemm.h) and the RVQ search
// (encode_states.cpp): LOWBIT_AMX is defined where the build's CPU has AMX BF16; the tile
// state must still be granted to the process by Linux (amx_granted) before a tile op runs.
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define LOWBIT_AMX 1

namespace lowbit_kv {
namespace {

inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// Every tile register 16 rows of 64 bytes. Loaded before each product: the configuration is
// the thread's, and oneDNN's AMX kernels on the same thread load their own.
inline void load_tile_config() {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  static const Config config = [] {
    Config c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
    return c;
  }();
  _tile_loadconfig(&config);
}

}  // namespace
}  // namespace lowbit_kv
#endif
