/* A C99 program on the C ABI (built with -std=c99 -pedantic-errors): one request through
 * admit, prompt entries, one step and a refused call; exits non-zero on any mismatch. */
#include <stdio.h>
#include <string.h>

#include "ess/ess_c.h"

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (!(cond)) {                                                           \
      fprintf(stderr, "c99_test: %s failed (line %d): %s\n", #cond, __LINE__, \
              ess_last_error());                                             \
      return 1;                                                              \
    }                                                                        \
  } while (0)

static DLTensor tensor(void* data, int ndim, int64_t* shape, uint8_t code, uint8_t bits) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

int main(void) {
  enum { K = 8, CTX = 64, ENTRY = 656 };
  ess_config config;
  ess_engine* engine = NULL;
  ess_engine_info info;
  static uint8_t prompt[CTX][ENTRY];
  uint8_t row_bytes[ENTRY];
  int64_t prompt_shape[2] = {CTX, ENTRY};
  int32_t rows[1], lengths[1] = {CTX}, topk[K], physical[K];
  int64_t b_shape[1] = {1}, k_shape[3] = {1, 1, K};
  DLTensor prompt_t, rows_t, lengths_t, topk_t, physical_t;
  ess_step_tensors bound;
  ess_step_binding* binding = NULL;
  int i;

  CHECK(ess_abi_version() == ESS_ABI_VERSION);
  ess_config_init(&config);
  config.layers = 2;
  config.max_requests = 2;
  config.max_context = CTX;
  config.topk = K;
  config.slots = 16;
  config.ratio = 0.5; /* and slots: refused, naming both */
  CHECK(ess_engine_create(&config, &engine) == ESS_ERROR_INVALID_ARGUMENT && engine == NULL);
  CHECK(strstr(ess_last_error(), "slots = 16 and ratio = 0.5") != NULL);
  config.ratio = 0;
  CHECK(ess_engine_create(&config, &engine) == ESS_OK);
  ess_engine_info_init(&info);
  CHECK(ess_engine_get_info(engine, &info) == ESS_OK && info.entry_bytes == ENTRY && info.rows_per_request == 16);

  CHECK(ess_request_admit(engine, 42, CTX, 1, &rows[0]) == ESS_OK && rows[0] == 1);
  for (i = 0; i < CTX; ++i) memset(prompt[i], i + 1, ENTRY);
  prompt_t = tensor(prompt, 2, prompt_shape, kDLUInt, 8);
  CHECK(ess_request_write_entries(engine, 42, 0, 0, &prompt_t) == ESS_OK);

  for (i = 0; i < K; ++i) topk[i] = 3 * i; /* every id a miss: slots 0..K-1 in order */
  rows_t = tensor(rows, 1, b_shape, kDLInt, 32);
  lengths_t = tensor(lengths, 1, b_shape, kDLInt, 32);
  topk_t = tensor(topk, 3, k_shape, kDLInt, 32);
  physical_t = tensor(physical, 3, k_shape, kDLInt, 32);
  ess_step_tensors_init(&bound);
  bound.rows = &rows_t;
  bound.topk = &topk_t;
  bound.lengths = &lengths_t;
  bound.physical = &physical_t;
  CHECK(ess_step_bind(engine, &bound, &binding) == ESS_OK);
  CHECK(ess_step(binding, 0, -1, NULL) == ESS_OK);
  for (i = 0; i < K; ++i) {
    CHECK(physical[i] == 1 * info.rows_per_request + i);
    CHECK(ess_engine_read_row(engine, 0, physical[i], row_bytes, ENTRY) == ESS_OK);
    CHECK(row_bytes[0] == (uint8_t)(3 * i + 1) && row_bytes[ENTRY - 1] == (uint8_t)(3 * i + 1));
  }
  /* An id past the length is refused by position; nothing changes. */
  topk[0] = CTX;
  CHECK(ess_step(binding, 0, -1, NULL) == ESS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ess_last_error(), "64") != NULL);
  CHECK(ess_step(binding, 7, -1, NULL) == ESS_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(ess_last_error(), "layer 7") != NULL);
  ess_engine_destroy(engine); /* destroys the binding too */
  printf("c99_test: ok (%s, ABI %d)\n", ess_version(), ess_abi_version());
  return 0;
}
