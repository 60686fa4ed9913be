// The page format as integer descriptors: vllm_lowbit_kv/ops/cpu.py builds them from the
// PageFormat (Descriptors), packed_attention.cpp reads pages and encode_states.cpp writes
// group states by them. Each list is the byte offsets of one codec's fields in one group
// state, in the order of the enums below (value offsets count from the value bytes).
#pragma once

#include <cstdint>
#include <vector>

namespace lowbit_kv {

enum Geometry { G_T, G_D, G_H, G_N, G_SINK_BYTES, G_STATE_BYTES, G_K_BYTES, G_COUNT };
enum KeyKind { KEY_KIVI_CHANNEL = 0, KEY_VIDKV = 1, KEY_RVQ = 2 };
// KEY_KIVI_CHANNEL: kind, bits, codes, scale, zero
enum KiviKey { KK_BITS = 1, KK_CODES, KK_SCALE, KK_ZERO, KK_COUNT };
// KEY_VIDKV: kind, n2, n1, n_protect, sign_levels, prot_scale, prot_zero, tok_mask,
//            prot_codes, chan_mask, scale2, zero2, codes2, codes1, lo1, hi1
enum VidKey {
  VK_N2 = 1, VK_N1, VK_NP, VK_SIGN, VK_PROT_SCALE, VK_PROT_ZERO, VK_TOK_MASK, VK_PROT_CODES,
  VK_CHAN_MASK, VK_SCALE2, VK_ZERO2, VK_CODES2, VK_CODES1, VK_LO1, VK_HI1, VK_COUNT
};
enum ValueKind { VAL_KIVI_TOKEN = 0, VAL_KIVI_CHANNEL = 1, VAL_TERNARY = 2, VAL_RVQ = 3 };
// VAL_KIVI_TOKEN: kind, bits, group_size, codes, scale, zero
enum KiviTokVal { KT_BITS = 1, KT_GROUP, KT_CODES, KT_SCALE, KT_ZERO, KT_COUNT };
// VAL_KIVI_CHANNEL: kind, bits, codes, scale, zero
enum KiviChanVal { KC_BITS = 1, KC_CODES, KC_SCALE, KC_ZERO, KC_COUNT };
// VAL_TERNARY: kind, n_protect, prot_scale, prot_zero, tok_mask, prot_codes, alpha, trits
enum TernVal {
  TV_NP = 1, TV_PROT_SCALE, TV_PROT_ZERO, TV_TOK_MASK, TV_PROT_CODES, TV_ALPHA, TV_TRITS, TV_COUNT
};
// KEY_RVQ / VAL_RVQ: kind, codebooks K, codebook size C, index bits, group size d^,
// strided (1: channel j * n + g of group g; 0: g * d^ + j), codes, std
enum Rvq { RV_K = 1, RV_C, RV_BITS, RV_GROUP, RV_STRIDED, RV_CODES, RV_STD, RV_COUNT };

// whether a codec's descriptor (the keys' with `keys`, else the values') is RVQ's
inline bool is_rvq(const std::vector<int64_t>& desc, bool keys) {
  return desc[0] == (keys ? int64_t(KEY_RVQ) : int64_t(VAL_RVQ));
}

}  // namespace lowbit_kv
