// A C++ caller of prefix-sidecar: register a fat prefix once, ask where it routes, then
// stream a completion of a thin query through the sidecar's unix socket.
//
//   prefix-sidecar-client --target unix:///var/run/prefix-sidecar/sidecar.sock
//       --name compliance-rules --prefix-file rules.txt
//       --input "Is a 2-for-15%-off plus cross-store discount allowed?"
//
// Output: one JSON object per line (proto3 JSON mapping of the reply, field names as in
// router.proto), so scripts and tests can parse it:
//   {"rpc":"RegisterPrefix","reply":{...Prefix...}}
//   {"rpc":"Route","reply":{...RouteReply...}}
//   {"rpc":"Complete","chunk":{...Chunk...}}        one per streamed message
//   {"rpc":"Complete","summary":{...Chunk...}}      all text, first backend, last usage
// A failed call prints the gRPC status on stderr and exits with 1; bad flags exit with 2.

#include <grpcpp/grpcpp.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "prefix_sidecar/v1/router.grpc.pb.h"

namespace {

using sidecar::v1::Chunk;
using sidecar::v1::CompleteRequest;
using sidecar::v1::Prefix;
using sidecar::v1::RegisterPrefixRequest;
using sidecar::v1::Router;
using sidecar::v1::RouteReply;
using sidecar::v1::RouteRequest;

const char kUsage[] =
    "usage: prefix-sidecar-client --target unix:///path.sock --name NAME\n"
    "           (--prefix-file FILE | --prefix-text TEXT) [--replicas N] [--prewarm]\n"
    "           [--input TEXT] [--max-tokens N] [--model MODEL] [--deadline-ms MS]\n"
    "           [--no-complete]\n";

struct Options {
  std::string target;
  std::string name;
  std::string prefix_text;
  std::string input = "Hello";
  std::string model;
  unsigned replicas = 0;
  unsigned max_tokens = 16;
  long deadline_ms = 30000;
  bool prewarm = false;
  bool complete = true;
};

[[noreturn]] void BadUsage(const std::string& why) {
  std::cerr << "prefix-sidecar-client: " << why << "\n" << kUsage;
  std::exit(2);
}

unsigned long ParseNumber(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    unsigned long number = std::stoul(value, &used);
    if (used == value.size()) return number;
  } catch (const std::exception&) {
  }
  BadUsage(flag + " needs a non-negative integer, got '" + value + "'");
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) BadUsage("cannot read --prefix-file " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Options ParseArgs(int argc, char** argv) {
  Options options;
  const std::map<std::string, bool> takes_value = {
      {"--target", true},     {"--name", true},        {"--prefix-file", true},
      {"--prefix-text", true}, {"--input", true},      {"--model", true},
      {"--replicas", true},   {"--max-tokens", true},  {"--deadline-ms", true},
      {"--prewarm", false},   {"--no-complete", false}, {"--help", false}};
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    auto known = takes_value.find(flag);
    if (known == takes_value.end()) BadUsage("unknown argument '" + flag + "'");
    std::string value;
    if (known->second) {
      if (i + 1 >= argc) BadUsage(flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (flag == "--target") {
      options.target = value;
    } else if (flag == "--name") {
      options.name = value;
    } else if (flag == "--prefix-file") {
      options.prefix_text = ReadFile(value);
    } else if (flag == "--prefix-text") {
      options.prefix_text = value;
    } else if (flag == "--input") {
      options.input = value;
    } else if (flag == "--model") {
      options.model = value;
    } else if (flag == "--replicas") {
      options.replicas = static_cast<unsigned>(ParseNumber(flag, value));
    } else if (flag == "--max-tokens") {
      options.max_tokens = static_cast<unsigned>(ParseNumber(flag, value));
    } else if (flag == "--deadline-ms") {
      options.deadline_ms = static_cast<long>(ParseNumber(flag, value));
    } else if (flag == "--prewarm") {
      options.prewarm = true;
    } else if (flag == "--no-complete") {
      options.complete = false;
    }
  }
  if (options.target.rfind("unix:", 0) != 0) {
    BadUsage("--target must be the sidecar's unix socket, e.g. unix:///tmp/prefix-sidecar.sock");
  }
  if (options.name.empty()) BadUsage("--name is required");
  if (options.prefix_text.empty()) BadUsage("--prefix-file or --prefix-text is required");
  return options;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;  // the names in router.proto, as Python prints them
#if GOOGLE_PROTOBUF_VERSION >= 5026000
  print.always_print_fields_with_no_presence = true;
#else
  print.always_print_primitive_fields = true;
#endif
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, print);
  if (!status.ok()) {
    std::cerr << "prefix-sidecar-client: cannot print a reply as JSON\n";
    std::exit(1);
  }
  return json;
}

void Emit(const std::string& rpc, const std::string& field,
          const google::protobuf::Message& message) {
  std::cout << "{\"rpc\":\"" << rpc << "\",\"" << field << "\":" << ToJson(message) << "}"
            << std::endl;
}

// Every call gets its own context; the deadline becomes the sidecar's upstream timeout.
std::unique_ptr<grpc::ClientContext> NewContext(const Options& options) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(options.deadline_ms));
  return context;
}

int Fail(const std::string& rpc, const grpc::Status& status) {
  std::cerr << "prefix-sidecar-client: " << rpc << " failed: code " << status.error_code()
            << ": " << status.error_message() << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = ParseArgs(argc, argv);
  auto channel = grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials());
  auto stub = Router::NewStub(channel);

  RegisterPrefixRequest register_request;
  register_request.set_name(options.name);
  register_request.set_text(options.prefix_text);
  register_request.set_replicas(options.replicas);
  register_request.set_prewarm(options.prewarm);
  Prefix prefix;
  grpc::Status status = stub->RegisterPrefix(NewContext(options).get(), register_request, &prefix);
  if (!status.ok()) return Fail("RegisterPrefix", status);
  Emit("RegisterPrefix", "reply", prefix);

  RouteRequest route_request;
  route_request.set_prefix_name(options.name);
  RouteReply route;
  status = stub->Route(NewContext(options).get(), route_request, &route);
  if (!status.ok()) return Fail("Route", status);
  Emit("Route", "reply", route);

  if (!options.complete) return 0;
  CompleteRequest complete_request;
  complete_request.set_prefix_id(prefix.id());
  complete_request.set_input(options.input);
  complete_request.set_max_tokens(options.max_tokens);
  if (!options.model.empty()) complete_request.set_model(options.model);
  auto context = NewContext(options);
  auto reader = stub->Complete(context.get(), complete_request);
  Chunk chunk;
  Chunk summary;
  while (reader->Read(&chunk)) {
    Emit("Complete", "chunk", chunk);
    summary.mutable_text()->append(chunk.text());
    if (summary.backend().empty()) summary.set_backend(chunk.backend());
    if (!chunk.finish_reason().empty()) summary.set_finish_reason(chunk.finish_reason());
    if (chunk.has_usage()) *summary.mutable_usage() = chunk.usage();
    summary.set_attempts(std::max(summary.attempts(), chunk.attempts()));
  }
  status = reader->Finish();
  if (!status.ok()) return Fail("Complete", status);
  Emit("Complete", "summary", summary);
  return 0;
}
