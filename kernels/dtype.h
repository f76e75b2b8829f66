// The element types keys and values are stored in on the host, and the scalar conversions
// between the wire/model dtypes (bf16, f16) and f32, for host and device.
#ifndef KVRECALL_KERNELS_DTYPE_H_
#define KVRECALL_KERNELS_DTYPE_H_

#include <cstdint>
#include <cstring>

namespace kvrecall {

// How a stored key or value row is encoded: f32, or the model's 16-bit dtype (bf16 / f16, raw
// little-endian bits). Queries, outputs and every accumulation stay f32 whatever the storage.
enum class KvElement : uint8_t { kF32 = 0, kBf16 = 1, kF16 = 2 };

constexpr int KvElementBytes(KvElement element) { return element == KvElement::kF32 ? 4 : 2; }

constexpr const char* KvElementName(KvElement element) {
  switch (element) {
    case KvElement::kF32: return "f32";
    case KvElement::kBf16: return "bf16";
    case KvElement::kF16: return "f16";
  }
  return "?";
}

// bf16 keeps f32's exponent: widening is a shift; narrowing rounds to nearest even.
inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half precision, done in software so it is exact on every host.
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t FloatToF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero: round to nearest even
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace kvrecall

#endif  // KVRECALL_KERNELS_DTYPE_H_
