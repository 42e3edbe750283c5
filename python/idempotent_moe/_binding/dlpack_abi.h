/*
 * dlpack_abi.h: the DLPack ABI as this binding consumes it, declared from the
 * DLPack specification (https://dmlc.github.io/dlpack/latest/c_api.html).
 *
 * Only what a consumer of major version 1 needs. Field types pin the sizes the
 * ABI fixes (an enum field of the reference header is an int32 here).
 */
#ifndef IMOE_DLPACK_ABI_H
#define IMOE_DLPACK_ABI_H

#include <stdint.h>

/* The major version this binding understands; any minor version is accepted. */
#define IMOE_DLPACK_MAJOR 1
#define IMOE_DLPACK_MINOR 1

/* Capsule names, before and after a consumer takes ownership. */
#define IMOE_DLPACK_CAPSULE "dltensor"
#define IMOE_DLPACK_CAPSULE_USED "used_dltensor"
#define IMOE_DLPACK_VERSIONED_CAPSULE "dltensor_versioned"
#define IMOE_DLPACK_VERSIONED_CAPSULE_USED "used_dltensor_versioned"

/* DLManagedTensorVersioned.flags */
#define IMOE_DLPACK_FLAG_READ_ONLY (UINT64_C(1) << 0)
#define IMOE_DLPACK_FLAG_IS_COPIED (UINT64_C(1) << 1)

typedef struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

/* DLDevice.device_type values this binding names. */
enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3, /* pinned host memory: the CPU can read and write it */
  kDLCUDAManaged = 13
};

typedef struct DLDevice {
  int32_t device_type;
  int32_t device_id;
} DLDevice;

/* DLDataType.code values. */
enum {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
  kDLFloat8_e3m4 = 7,
  kDLFloat8_e4m3 = 8,
  kDLFloat8_e4m3b11fnuz = 9,
  kDLFloat8_e4m3fn = 10,
  kDLFloat8_e4m3fnuz = 11,
  kDLFloat8_e5m2 = 12,
  kDLFloat8_e5m2fnuz = 13,
  kDLFloat8_e8m0fnu = 14
};

typedef struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct DLTensor {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides; /* in elements; NULL means compact row-major */
  uint64_t byte_offset;
} DLTensor;

/* The legacy (unversioned) tensor, capsule name "dltensor". */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/*
 * The versioned tensor, capsule name "dltensor_versioned". version,
 * manager_ctx and deleter come first and keep their place in every major
 * version, so a consumer can read the version and still free a tensor of a
 * major version it does not understand.
 */
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

/*
 * The C exchange table of DLPack 1.3 (dlpack.h's DLPackExchangeAPI): a
 * framework publishes it as a capsule named "dlpack_exchange_api" in the
 * attribute __dlpack_c_exchange_api__ of its tensor type. Its header keeps
 * its place in every version; the functions below are those of major 1.
 */
#define IMOE_DLPACK_EXCHANGE_CAPSULE "dlpack_exchange_api"

typedef struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                  void *error_ctx,
                                  void (*set_error)(void *error_ctx, const char *kind,
                                                    const char *message));
  int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
  int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                             void **out_py_object);
  /* Fills a DLTensor that borrows the object's shape and strides: valid while
   * the object lives and is not resized. 0, or -1 with a Python exception. */
  int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
  /* The framework's current stream on a device (torch.cuda.current_stream). */
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#endif /* IMOE_DLPACK_ABI_H */
