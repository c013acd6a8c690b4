# Inputs of the image-crawler module. No AWS keys here on purpose: the
# containers get credentials from the instance profile (main.tf).

variable "name" {
  description = "Prefix for every resource's name, e.g. image-crawler-prod."
  type        = string
  default     = "image-crawler"
}

variable "vpc_id" {
  description = "VPC the instances run in; it must reach Redis, Kafka, S3, the registry and the web."
  type        = string
}

variable "subnet_ids" {
  description = "Subnets for the instances (private ones with a NAT gateway); workers are spread over them."
  type        = list(string)
}

variable "ami_id" {
  description = "AMI with Docker available through dnf; null picks the latest Amazon Linux 2023 (x86_64)."
  type        = string
  default     = null
}

variable "image_registry" {
  description = "Registry prefix holding the images built from Dockerfile-monitor and Dockerfile-worker, pushed as <registry>/image-crawler-monitor and <registry>/image-crawler-worker (e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com)."
  type        = string
}

variable "image_tag" {
  description = "Tag of both images; pin a release rather than latest so a reboot never changes the code."
  type        = string
}

variable "worker_count" {
  description = "Worker instances, one worker container each. Keep it well under url_partitions, so every worker owns several partitions of urls."
  type        = number
  default     = 2
}

variable "worker_instance_type" {
  description = "Instance type of the workers (image decoding is CPU-bound)."
  type        = string
  default     = "c6i.large"
}

variable "monitor_instance_type" {
  description = "Instance type of the single monitor (splitter, regulator, breaker, dashboard)."
  type        = string
  default     = "t3.small"
}

variable "redis_url" {
  description = "REDIS_URL for every container. If it holds a password, put the whole URL in SSM instead (ssm_environment = { REDIS_URL = \"/path\" }): user data is readable by anyone allowed ec2:DescribeInstanceAttribute."
  type        = string
}

variable "kafka_hosts" {
  description = "KAFKA_HOSTS: comma-separated host:port bootstrap servers."
  type        = string
}

variable "s3_bucket" {
  description = "S3_BUCKET for thumbnails; the instance role may write to it."
  type        = string
}

variable "sources_url" {
  description = "SOURCES_URL (source sizes for the computed rates); null keeps the crawler's default, the Openverse stats endpoint."
  type        = string
  default     = null
}

variable "url_partitions" {
  description = "URL_PARTITIONS: partitions of the one urls topic every source's URLs go through (about 8 per worker you may run; grow it with kafka-topics --alter)."
  type        = number
  default     = 256
}

variable "max_tasks" {
  description = "MAX_TASKS: concurrent downloads per worker."
  type        = number
  default     = 500
}

variable "crawl_user_agent" {
  description = "CRAWL_USER_AGENT with a contact URL for site owners; null keeps the crawler's default."
  type        = string
  default     = null
}

variable "monitor_port" {
  description = "MONITOR_PORT: the monitor's dashboard, /status and /metrics."
  type        = number
  default     = 8090
}

variable "operator_cidr_blocks" {
  description = "Networks allowed to reach the monitor's port (operators' VPN, Prometheus). Empty: reach it with an SSM port forward instead. There is no SSH: use aws ssm start-session."
  type        = list(string)
  default     = []
  validation {
    condition     = alltrue([for cidr in var.operator_cidr_blocks : !contains(["0.0.0.0/0", "::/0"], cidr)])
    error_message = "The dashboard has no login: do not open it to 0.0.0.0/0 or ::/0."
  }
}

variable "ssm_environment" {
  description = "Settings read from SSM Parameter Store (SecureString) at boot, name => parameter name, e.g. { REDIS_URL = \"/image-crawler/prod/redis-url\" }. They win over the plain settings."
  type        = map(string)
  default     = {}
}

variable "extra_environment" {
  description = "More settings for both containers, e.g. { MAX_RETRIES = \"2\", CRAWL_PER_HOST_CONNECTIONS = \"4\" }."
  type        = map(string)
  default     = {}
}

variable "log_retention_days" {
  description = "Days CloudWatch keeps the containers' JSON logs: a year, to compare a source's behaviour across crawls."
  type        = number
  default     = 365
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
