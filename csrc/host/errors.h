// How the host code reports bad input: std::invalid_argument reaches Python as ValueError; a TypeError travels as a
// ValueError whose message starts with "TypeError: ", which fa2's Python layer re-raises as TypeError. Defined in
// checks.cpp; no torch here, so torch-free host code (plan.cpp) can raise them too.
#pragma once

#include <string>

namespace fa2::host {

[[noreturn]] void value_error(const std::string& msg);
[[noreturn]] void type_error(const std::string& msg);

}  // namespace fa2::host
