// The C ABI's capacity planner: `ess plan` as one call, JSON in and out.
#include <cstring>

#include <nlohmann/json.hpp>

#include "capi/capi_internal.h"
#include "ess/sim/inputs.h"

extern "C" ess_status ess_plan(const char* request_json, char** result_json) {
  if (result_json != nullptr) *result_json = nullptr;
  return ess::capi::guard("ess_plan", [&] {
    ESS_CHECK(result_json != nullptr, "the result out-pointer is NULL");
    nlohmann::json request = nlohmann::json::object();
    if (request_json != nullptr && request_json[0] != '\0') {
      try {
        request = nlohmann::json::parse(request_json);
      } catch (const nlohmann::json::exception& e) {
        ESS_THROW("the plan request is not JSON: {}", e.what());
      }
    }
    ess::sim::Inputs inputs;
    ess::sim::PlanOptions options;
    ess::sim::read_plan_request(request, inputs, options);
    const std::string text = ess::sim::to_json(ess::sim::plan_contexts(inputs, options)).dump();
    auto* out = new char[text.size() + 1];
    std::memcpy(out, text.c_str(), text.size() + 1);
    *result_json = out;
  });
}
